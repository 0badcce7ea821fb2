"""`AsyncTranscriber`: Whisper transcription over `AsyncLLM` (the server and async callers).

`events` runs one plan per waveform at once and yields each window's text as it is decoded
(WindowText) and each input's result (InputDone); closing it aborts every plan's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from v1.engine.beam_search import run_beam_search_async
from v1.engine.transcription.loading import load_audio_inputs
from v1.engine.transcription.plan import (
    Plan,
    TranscriptionOptions,
    TranscriptionPlanner,
    TranscriptionResult,
    WindowOutput,
    WindowRequest,
)
from v1.engine.transcription.windows import (
    WindowCollector,
    advance_plan,
    beam_window_output,
    window_beam_search,
)
from v1.outputs import RequestOutputKind


@dataclass(frozen=True)
class WindowText:
    """Text a window request decoded since the last event (planners with stream_text)."""

    index: int
    """The audio input."""
    text: str


@dataclass(frozen=True)
class InputDone:
    """One audio input's result."""

    index: int
    result: TranscriptionResult


TranscriptionEvent = WindowText | InputDone


class AsyncTranscriber:
    """Transcription over `AsyncLLM` (which builds one, with its engine's Whisper input
    builder): `prepare` checks a call's options, `events` runs its plans."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.builder = llm.input_processor.whisper_builder

    async def transcribe(
        self,
        audio: Any,
        *,
        request_id: str | None = None,
        lora_request: Any = None,
        **options: Any,
    ) -> list[TranscriptionResult]:
        """As `Transcriber.transcribe`; `request_id` prefixes the ids of its requests,
        `lora_request` is the LoRA adapter every request runs with."""
        planner = await self.prepare(
            TranscriptionOptions.from_kwargs(options), request_id, lora_request=lora_request
        )
        waveforms = await asyncio.to_thread(load_audio_inputs, audio)
        results: list[TranscriptionResult | None] = [None] * len(waveforms)
        async with contextlib.aclosing(self.events(planner, waveforms)) as events:
            async for event in events:
                if isinstance(event, InputDone):
                    results[event.index] = event.result
        return results  # type: ignore[return-value]

    async def prepare(
        self,
        options: TranscriptionOptions,
        request_id: str | None = None,
        *,
        stream_text: bool = False,
        lora_request: Any = None,
    ) -> TranscriptionPlanner:
        """The checked options (ValueError on anything that cannot run), on the engine's
        input thread (the prompt is tokenized). `stream_text`: `events` yields WindowText.
        `lora_request`: the LoRA adapter every request of the plans runs with (checked)."""
        prefix = request_id or f"transcribe-{uuid.uuid4().hex}"
        await self.llm.check_health()  # EngineDeadError, not the input thread's shutdown error
        return await self.llm.run_input_work(
            self._planner, options, prefix, stream_text, lora_request
        )

    def _planner(
        self, options: TranscriptionOptions, prefix: str, stream_text: bool, lora_request: Any
    ) -> TranscriptionPlanner:
        if lora_request is not None:
            self.llm.input_processor.check_lora(lora_request)
        return TranscriptionPlanner(
            self.builder, options, prefix, stream_text=stream_text, lora_request=lora_request
        )

    async def events(
        self, planner: TranscriptionPlanner, waveforms: list[np.ndarray]
    ) -> AsyncIterator[TranscriptionEvent]:
        """Runs one plan per waveform (16 kHz float32, from `load_audio`), all at once: each
        window's text as it is decoded (WindowText, in order within an input) and each input's
        result (InputDone). Closing the iterator, or an error, stops every plan and aborts its
        requests."""
        queue: asyncio.Queue[TranscriptionEvent | Exception] = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._drive(i, planner.plan(i, w), queue.put_nowait))
            for i, w in enumerate(waveforms)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, InputDone):
                    remaining -= 1
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drive(
        self, index: int, plan: Plan, emit: Callable[[TranscriptionEvent | Exception], None]
    ) -> None:
        """One plan, window after window; the plan itself advances on the input thread (it
        hashes audio and decodes text with the tokenizer)."""
        try:
            output: WindowOutput | None = None
            while True:
                await self.llm.check_health()
                request, result = await self.llm.run_input_work(advance_plan, plan, output)
                if request is None:
                    assert result is not None
                    emit(InputDone(index, result))
                    return
                output = await self._run_window(index, request, emit)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer of events, which raises it
            emit(e)

    async def _run_window(
        self, index: int, request: WindowRequest, emit: Callable[[TranscriptionEvent], None]
    ) -> WindowOutput:
        if request.beam is not None:
            search = window_beam_search(request)
            await run_beam_search_async(
                [search], self.llm.run_core_requests_async, self.llm.release_core_requests
            )
            return beam_window_output(search)
        collector = WindowCollector(f"audio input {index}", request.length_penalty)
        async for output in self.llm.generate_processed(
            request.request_id,
            request.prompt,
            request.params,
            request.core_requests,
            output_kind=RequestOutputKind.DELTA,
        ):
            text = collector.add(output)
            if text:
                emit(WindowText(index, text))
        return collector.result()
