"""Whisper transcription over the engine: audio -> seek-based 30 s windows -> timed segments.

The audio is decoded once, at the edge (`load_audio_inputs`); a `TranscriptionPlanner`
(transcription_plan.py) checks the options once and plans each waveform window by window. Two
drivers run the same plans: `Transcriber` over the synchronous `LLMEngine` (the offline `LLM`),
and `AsyncTranscriber` over `AsyncLLM`, whose `events` yield each window's text as it is
decoded and each input's result (the server's JSON, verbose and streamed responses all read
them). `LLM` and `AsyncLLM` hold one transcriber each, built with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from v1.audio import SAMPLE_RATE, AudioError, load_audio
from v1.engine.beam_search import (
    BeamSearch,
    advance_beam_searches,
    beam_step_requests,
    run_beam_search_async,
    take_step_request_ids,
)
from v1.engine.inputs.whisper import WINDOW_SECONDS
from v1.engine.output_processor import LazySampleLogprobs
from v1.engine.transcription_plan import (
    FileProgress,
    Plan,
    TranscriptionError,
    TranscriptionOptions,
    TranscriptionPlanner,
    TranscriptionResult,
    TranscriptionSegment,
    WindowOutput,
    WindowRequest,
)
from v1.gc_policy import deferred_full_collections
from v1.outputs import RequestOutput, RequestOutputKind

__all__ = [  # with the plan's types its callers use
    "AsyncTranscriber",
    "InputDone",
    "TranscriptionError",
    "TranscriptionEvent",
    "TranscriptionOptions",
    "TranscriptionPlanner",
    "TranscriptionResult",
    "TranscriptionSegment",
    "Transcriber",
    "WindowText",
    "load_audio_inputs",
]

NO_SPEECH_PROB = "no_speech_prob"
TOKEN_TIMES = "token_times"
"""Keys of a Whisper request's `RequestOutput.extras`."""


_PARALLEL_LOAD_MIN = 8
"""Inputs below which `load_audio_inputs` loads on the calling thread."""
_LOAD_THREADS = min(8, os.cpu_count() or 1)


def load_audio_inputs(audio: Any) -> list[np.ndarray]:
    """One source or a list of them (path, bytes, `(samples, sample_rate)`) -> float32 16 kHz
    waveforms; every input is checked before any request is made. The one `load_audio` of a
    transcription: its windows use these samples as they are."""
    sources = audio if isinstance(audio, list) else [audio]
    if not sources:
        raise AudioError("no audio given (an empty list)")

    def load(i: int) -> np.ndarray:
        try:
            return load_audio(sources[i])
        except AudioError as e:
            where = f"audio input {i}: " if len(sources) > 1 else ""
            raise AudioError(f"{where}{e}") from e

    if len(sources) < _PARALLEL_LOAD_MIN:
        return [load(i) for i in range(len(sources))]
    # Threads: decoding and the finiteness check of in-memory samples (a sum over every
    # sample) release the GIL. One thread checked 256 clips of 30 s in ~45 ms, all before the
    # first engine step. map() raises the first failing input's error, in input order.
    with ThreadPoolExecutor(min(_LOAD_THREADS, len(sources))) as pool:
        return list(pool.map(load, range(len(sources))))


def advance_plan(
    plan: Plan, output: WindowOutput | None
) -> tuple[WindowRequest | None, TranscriptionResult | None]:
    """(next request, None) or (None, the plan's result): `plan.send` without StopIteration
    (which cannot cross a thread pool's future)."""
    try:
        return plan.send(output), None  # type: ignore[arg-type]
    except StopIteration as stop:
        return None, stop.value


# ---- window outputs ----
class WindowCollector:
    """The outputs of one window request -> its WindowOutput. Takes deltas (each output
    carries what is new) or one final output alike; of n > 1 samples the best ranked is kept
    (openai-whisper's best_of)."""

    def __init__(self, what: str, length_penalty: float | None = None) -> None:
        """`what` names the request in errors ("audio input 2")."""
        self.what = what
        self.length_penalty = length_penalty
        self.token_ids: dict[int, list[int]] = {}
        """Per sample index."""
        self.logprobs: dict[int, list[float] | None] = {}
        self.extras: dict[str, Any] = {}
        self.finished = False

    def add(self, output: RequestOutput) -> str:
        """Takes one output; returns its new text (empty unless the request detokenizes).
        TranscriptionError when the engine failed the request."""
        if output.error is not None:
            raise TranscriptionError(f"{self.what}: {output.error}")
        text = ""
        for completion in output.outputs:
            k = completion.index
            self.token_ids.setdefault(k, []).extend(completion.token_ids)
            logprobs = self.logprobs.setdefault(k, [])
            if completion.logprobs is None or logprobs is None:
                self.logprobs[k] = None
            elif isinstance(completion.logprobs, LazySampleLogprobs):
                values = completion.logprobs.sampled_logprobs()
                assert len(values) == len(completion.token_ids)
                logprobs += values
            else:
                logprobs += [
                    entry[token].logprob
                    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
                ]
            text += completion.text
        self.extras.update(output.extras or {})
        self.finished = self.finished or output.finished
        return text

    def result(self) -> WindowOutput:
        if not self.finished:
            raise TranscriptionError(f"{self.what}: the request ended without an output")
        best = max(
            sorted(self.token_ids), key=lambda k: _rank(self.logprobs[k], self.length_penalty)
        )
        token_times = self.extras.get(TOKEN_TIMES) if len(self.token_ids) == 1 else None
        return WindowOutput(
            self.token_ids[best],
            self.logprobs[best],
            self.extras.get(NO_SPEECH_PROB),
            list(token_times) if token_times is not None else None,
        )


def _rank(logprobs: list[float] | None, length_penalty: float | None) -> float:
    """openai-whisper's MaximumLikelihoodRanker score of one sample."""
    if not logprobs:
        return float("-inf")
    length = len(logprobs)
    penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
    return math.fsum(logprobs) / penalty


def window_beam_search(request: WindowRequest) -> BeamSearch:
    """The beam search of a window request with `beam` (its one core request is the base)."""
    (base,) = request.core_requests
    assert request.beam is not None and base.sampling_params is not None
    eos_ids = [] if base.eos_token_id is None else [base.eos_token_id]
    eos_ids += [t for t in base.sampling_params.stop_token_ids or [] if t not in eos_ids]
    return BeamSearch(base, request.beam, eos_ids)


def beam_window_output(search: BeamSearch) -> WindowOutput:
    """The best beam of a finished window beam search."""
    best = search.result()[0]
    return WindowOutput(best.token_ids, best.logprobs, search.first_extras.get(NO_SPEECH_PROB))


# ---- offline ----
class ProgressBar:
    """A tqdm bar over seconds of audio with the real-time factor (audio s / wall s)."""

    def __init__(self, progress: list[FileProgress], enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.progress = progress
        self.start = time.perf_counter()
        self.shown = 0.0
        total = sum(p.duration for p in progress)
        self.bar = tqdm(
            total=round(total, 1),
            desc="Transcribing",
            unit="s",
            unit_scale=False,
            bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s audio [{elapsed}<{remaining}{postfix}]",
            dynamic_ncols=True,
            disable=not enabled,
        )

    def refresh(self) -> None:
        done = round(sum(p.done for p in self.progress), 1)
        if done <= self.shown:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"RTFx {done / elapsed:.1f}", refresh=False)
        self.bar.update(done - self.shown)
        self.shown = done

    def close(self) -> None:
        self.bar.close()


def show_progress(use_tqdm: bool, progress: list[FileProgress]) -> bool:
    """Bars are for batches and for audio longer than one window."""
    return use_tqdm and (len(progress) > 1 or any(p.duration > WINDOW_SECONDS for p in progress))


class Transcriber:
    """Transcription over a synchronous engine (`LLMEngine`: add_processed_request, step,
    abort_request, and the core-request calls of beam search), with the engine's Whisper input
    builder. `LLM` builds one."""

    def __init__(self, engine: Any, max_active_files: int | None = None) -> None:
        """`max_active_files`: files decoded at once (default: twice max_num_seqs per engine core;
        each has one window in flight)."""
        self.engine = engine
        self.builder = engine.input_processor.whisper_builder
        config = getattr(engine, "config", None)
        num_cores = config.parallel_config.data_parallel_size if config is not None else 1
        if max_active_files is None:
            max_num_seqs = config.scheduler_config.max_num_seqs if config is not None else 128
            max_active_files = 2 * max_num_seqs * num_cores
        self.max_active_files = max(1, max_active_files)
        self.files_per_step = num_cores * (
            max(1, config.encoder_budget // config.model_config.max_encoder_len)
            if config is not None
            else 16
        )
        """Files started between two engine steps: one step's encoder budget of windows per
        engine core (data parallelism: each core steps on its own)."""
        self.num_cores = num_cores

    def transcribe(
        self, audio: Any, *, use_tqdm: bool = False, **options: Any
    ) -> list[TranscriptionResult]:
        """One result per input, in order; `options` are `TranscriptionOptions` fields.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. Files advance
        window by window (each window depends on the one before); the windows of many files
        run in the same engine steps. Raises ValueError (AudioError for audio) on bad input
        before anything runs, and TranscriptionError if the engine fails a request."""
        planner = TranscriptionPlanner(
            self.builder,
            TranscriptionOptions.from_kwargs(options),
            f"transcribe-{uuid.uuid4().hex}",
        )
        waveforms = load_audio_inputs(audio)
        progress = [FileProgress(w.shape[0] / SAMPLE_RATE) for w in waveforms]
        plans = [
            planner.plan(i, w, p) for i, (w, p) in enumerate(zip(waveforms, progress, strict=True))
        ]
        bar = ProgressBar(progress, show_progress(use_tqdm, progress))
        try:
            run = _SyncRun(
                self.engine, plans, self.max_active_files, self.files_per_step, self.num_cores
            )
            return run.run(bar.refresh)
        finally:
            bar.close()


class _SyncRun:
    """Many files' plans over one synchronous engine: each file has one window in flight, and
    at most `max_active` files run at once; their windows share the engine's steps. Files
    start `files_per_step` (one step's encoder budget) between two steps, and one more before
    the first: a launched step (pipelined on CUDA) runs the first windows' encoder while the
    host prepares the next files' requests, and the one file the step could not take keeps a
    request unscheduled, so every step() launches step N+1 before it reads back step N. With
    exactly one step's worth at a time the engine had nothing to launch ahead: the device
    idled between encoder steps while the host read back, started the next files and
    scheduled them (H100, large-v3-turbo shape, 256 clips x 1 token,
    `benchmarks/profile_step.py --tokens 1`: 1.53 -> 1.32 s; at 100 tokens the decode steps
    already kept the pipeline full)."""

    def __init__(
        self,
        engine: Any,
        plans: list[Plan],
        max_active: int,
        files_per_step: int = 1 << 30,
        num_cores: int = 1,
    ) -> None:
        self.engine = engine
        self.num_cores = num_cores
        self.plans = plans
        self.max_active = max_active
        self.files_per_step = files_per_step
        self.pending: dict[str, tuple[int, WindowCollector]] = {}
        """req_id -> (plan index, the outputs of its window)."""
        self.beams: dict[str, tuple[BeamSearch, int, list]] = {}
        """Window beam searches: req_id -> (search, plan index, step keys)."""
        self.results: list[TranscriptionResult | None] = [None] * len(plans)
        self.waiting = deque(range(len(plans)))
        self.active: set[int] = set()

    def run(self, on_progress: Callable[[], None]) -> list[TranscriptionResult]:
        engine = self.engine
        try:
            with deferred_full_collections():
                self._run(on_progress)
        except BaseException:
            if self.pending:
                engine.abort_request(list(self.pending))
            # The last step of each search: in flight, or held for forks.
            in_flight = take_step_request_ids([search for search, *_ in self.beams.values()])
            if in_flight:
                engine.abort_core_requests(in_flight)
            raise
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def _run(self, on_progress: Callable[[], None]) -> None:
        engine = self.engine
        self._start_waiting(extra=self.num_cores)  # one unscheduled file per core
        while self.pending or self.beams or self.waiting:
            for output in engine.step():
                entry = self.pending.get(output.request_id)
                if entry is None:
                    continue
                i, collector = entry
                collector.add(output)
                if output.finished:
                    del self.pending[output.request_id]
                    self._advance(i, collector.result())
            for req_id in list(self.beams):
                self._step_beam(req_id)
            self._start_waiting()
            on_progress()

    def _advance(self, i: int, output: WindowOutput | None) -> None:
        request, result = advance_plan(self.plans[i], output)
        if request is None:
            self.results[i] = result
            self.active.discard(i)
            return
        if request.beam is not None:
            self.beams[request.request_id] = (window_beam_search(request), i, [])
            self._step_beam(request.request_id)
            return
        # The collector reads only the sampled tokens' logprobs: no Logprob entry per token.
        self.engine.add_processed_request(
            request.request_id,
            request.prompt,
            request.params,
            request.core_requests,
            lazy_logprobs=True,
        )
        self.pending[request.request_id] = (
            i,
            WindowCollector(f"audio input {i}", request.length_penalty),
        )

    def _step_beam(self, req_id: str) -> None:
        """Feeds a window's beam search its last step's outputs once all are in, then queues
        its next step (or hands its best beam to the plan)."""
        if req_id not in self.beams:
            return
        engine = self.engine
        search, i, keys = self.beams[req_id]
        if keys:
            step_ids = [key[2] for key in keys]
            if not engine.core_outputs_ready(step_ids):
                return
            outputs = {r: engine.take_core_output(r) for r in step_ids}
            advance_beam_searches([search], keys, outputs)
        while not search.done:
            step = beam_step_requests([search])
            if step.requests:
                self.beams[req_id] = (search, i, step.keys)
                engine.add_core_requests(step.requests)
            if step.release_ids:
                engine.abort_core_requests(step.release_ids)  # parents nothing forks from
            if step.requests:
                return
            advance_beam_searches([search], step.keys, {})  # a forced step: no engine work
        engine.abort_core_requests(take_step_request_ids([search]))  # the last step's KV
        del self.beams[req_id]
        self._advance(i, beam_window_output(search))

    def _start_waiting(self, extra: int = 0) -> None:
        """Starts up to one step's encoder budget of waiting files, and `extra` more (as
        `max_active` allows)."""
        started = 0
        while self.waiting and len(self.active) < self.max_active:
            if started == self.files_per_step + extra:
                return  # the rest after the next step (launched meanwhile)
            started += 1
            i = self.waiting.popleft()
            self.active.add(i)
            self._advance(i, None)


# ---- asyncio ----
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
        self, audio: Any, *, request_id: str | None = None, **options: Any
    ) -> list[TranscriptionResult]:
        """As `Transcriber.transcribe`; `request_id` prefixes the ids of its requests."""
        planner = await self.prepare(TranscriptionOptions.from_kwargs(options), request_id)
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
    ) -> TranscriptionPlanner:
        """The checked options (ValueError on anything that cannot run), on the engine's
        input thread (the prompt is tokenized). `stream_text`: `events` yields WindowText."""
        prefix = request_id or f"transcribe-{uuid.uuid4().hex}"
        await self.llm.check_health()  # EngineDeadError, not the input thread's shutdown error
        return await self.llm.run_input_work(
            TranscriptionPlanner, self.builder, options, prefix, stream_text=stream_text
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
