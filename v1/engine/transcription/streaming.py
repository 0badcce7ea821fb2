"""`AsyncTranscriber`: Whisper transcription over `AsyncLLM` (the server and async callers).

`events` runs one plan per waveform at once and yields each window's text as it is decoded
(WindowText) and each input's result (InputDone); closing it aborts every plan's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from v1.audio import SAMPLE_RATE
from v1.engine.beam_search import run_beam_search_async
from v1.engine.transcription.batching import ChunkJoiner, speech_chunks
from v1.engine.transcription.loading import load_audio_inputs
from v1.engine.transcription.options import TranscriptionOptions
from v1.engine.transcription.plan import TranscriptionPlanner
from v1.engine.transcription.plan_io import Plan, WindowOutput, WindowRequest
from v1.engine.transcription.segments import TranscriptionResult
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
        drive = self._drive_batched if planner.options.batch_size is not None else self._drive
        tasks = [
            asyncio.ensure_future(drive(i, planner, w, queue.put_nowait))
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
        self,
        index: int,
        planner: TranscriptionPlanner,
        samples: np.ndarray,
        emit: Callable[[TranscriptionEvent | Exception], None],
    ) -> None:
        """One file's plan; its result (or error) goes to `emit`."""
        try:
            result = await self._run_plan(
                planner.plan(index, samples),
                (lambda text: emit(WindowText(index, text))) if planner.stream_text else None,
                f"audio input {index}",
            )
            emit(InputDone(index, result))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer of events, which raises it
            emit(e)

    async def _drive_batched(
        self,
        index: int,
        planner: TranscriptionPlanner,
        samples: np.ndarray,
        emit: Callable[[TranscriptionEvent | Exception], None],
    ) -> None:
        """batch_size (faster-whisper's batched pipeline): the file's chunks (VAD speech or
        plain 30 s pieces), its language detected once, then up to batch_size chunks decoded
        at once, each on its own; their text goes out in chunk order and the result joins
        them on the file's clock."""
        options = planner.options
        batch_size = options.batch_size
        assert batch_size is not None
        tasks: list[asyncio.Future[TranscriptionResult]] = []
        try:
            vad = options.vad_parameters if options.vad_filter else None
            chunks = await self.llm.run_input_work(speech_chunks, samples, vad)
            language: tuple[str | None, float | None] = (
                planner.language,
                1.0 if planner.language else None,
            )
            detect = planner.tokens.multilingual and planner.language is None
            if detect and not options.multilingual and chunks:
                first_start, first_end = chunks[0]
                plan = planner.detect_plan(index, samples[first_start:first_end])
                language = await self._run_plan(plan, None, f"audio input {index}")
            chunk_planner = planner.for_chunks(language[0])
            chunk_planner.prefix = f"{planner.prefix}-{index}b"  # ids apart from other files'
            texts = _InOrder(len(chunks), lambda text: emit(WindowText(index, text)))
            gate = asyncio.Semaphore(batch_size)

            async def chunk(k: int, start: int, end: int) -> TranscriptionResult:
                chunk_k = chunk_planner
                if k:
                    chunk_k = copy.copy(chunk_planner)
                    chunk_k.prefix_ids = []  # the prefix starts the file only
                async with gate:
                    result = await self._run_plan(
                        chunk_k.plan(k, samples[start:end]),
                        functools.partial(texts.put, k) if planner.stream_text else None,
                        f"audio input {index}",
                    )
                texts.done(k)
                return result

            tasks = [asyncio.ensure_future(chunk(k, *c)) for k, c in enumerate(chunks)]
            results = await asyncio.gather(*tasks)
            joiner = ChunkJoiner(samples.shape[0] / SAMPLE_RATE, options.word_timestamps)
            for (start, _), result in zip(chunks, results, strict=True):
                for segment in result.segments:
                    joiner.place(start / SAMPLE_RATE, segment)
            emit(InputDone(index, joiner.result(results, language, planner.language or "en")))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer of events, which raises it
            emit(e)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_plan(self, plan: Plan, on_text: Callable[[str], None] | None, what: str) -> Any:
        """One plan, window after window, to its result; the plan itself advances on the
        input thread (it hashes audio and decodes text with the tokenizer). `on_text`: takes
        each window's text as it is decoded; None: nobody reads it before the window ends."""
        output: WindowOutput | None = None
        while True:
            await self.llm.check_health()
            request, result = await self.llm.run_input_work(advance_plan, plan, output)
            if request is None:
                return result
            output = await self._run_window(request, on_text, what)

    async def _run_window(
        self, request: WindowRequest, on_text: Callable[[str], None] | None, what: str
    ) -> WindowOutput:
        if request.beam is not None:
            search = window_beam_search(request)
            await run_beam_search_async(
                [search], self.llm.run_core_requests_async, self.llm.release_core_requests
            )
            return beam_window_output(search)
        collector = WindowCollector(what, request.length_penalty)
        # A window whose text nobody reads as it comes is one final output (and its requests
        # may run in decode bursts: EngineCoreRequest.streamed).
        kind = RequestOutputKind.FINAL_ONLY if on_text is None else RequestOutputKind.DELTA
        async for output in self.llm.generate_processed(
            request.request_id,
            request.prompt,
            request.params,
            request.core_requests,
            output_kind=kind,
        ):
            text = collector.add(output)
            if text and on_text is not None:
                on_text(text)
        return collector.result()


class _InOrder:
    """Texts of parts that run at once, passed on in part order: part k's text waits until
    every part before it is done."""

    def __init__(self, num_parts: int, out: Callable[[str], None]) -> None:
        self.out = out
        self.buffers: list[list[str]] = [[] for _ in range(num_parts)]
        self.finished = [False] * num_parts
        self.current = 0

    def put(self, part: int, text: str) -> None:
        if part == self.current:
            self.out(text)
        else:
            self.buffers[part].append(text)

    def done(self, part: int) -> None:
        self.finished[part] = True
        while self.current < len(self.finished) and self.finished[self.current]:
            self.current += 1
            if self.current < len(self.buffers):
                for text in self.buffers[self.current]:
                    self.out(text)
                self.buffers[self.current] = []
