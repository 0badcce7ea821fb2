"""`Transcriber`: Whisper transcription over the synchronous `LLMEngine` (the offline `LLM`).

Many files' plans share the engine's steps, each file with one window in flight; files start
one step's encoder budget at a time (plus one, so a pipelined step always has work queued),
the first few alone so the device starts sooner.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from v1.audio import SAMPLE_RATE
from v1.engine.beam_search import (
    BeamSearch,
    advance_beam_searches,
    beam_step_requests,
    take_step_request_ids,
)
from v1.engine.inputs.whisper import WINDOW_SECONDS
from v1.engine.transcription.chunk_feed import ChunkFeed, Unit
from v1.engine.transcription.loading import load_audio_inputs
from v1.engine.transcription.options import TranscriptionOptions
from v1.engine.transcription.plan import TranscriptionPlanner
from v1.engine.transcription.plan_io import FileProgress, Plan, WindowOutput
from v1.engine.transcription.segments import TranscriptionResult, TranscriptionSegment
from v1.engine.transcription.windows import (
    WindowCollector,
    advance_plan,
    beam_window_output,
    window_beam_search,
)
from v1.gc_policy import deferred_full_collections

FIRST_FILES = 8
"""Files a run sends first, alone, per engine core in its own process: the core's first encoder
step then waits only for these (their audio checked, hashed and sent), and the rest of the first
step budget follows in a second message while it runs. On an H200, large-v3-turbo over 256
clips: with 33 files in the first message the core's first step came 0.06-0.09 s into a ~1.6 s
run (0.035 s with the core in this process; session 20's trace). An engine in this process
gets no such split: it would launch the few files' step and then wait for it."""


class ProgressBar:
    """A tqdm bar over seconds of audio with the real-time factor (audio s / wall s)."""

    def __init__(
        self,
        progress: list[FileProgress],
        enabled: bool,
        total: list[FileProgress] | None = None,
    ) -> None:
        """`progress`: the plans' progress (a list that may grow while the bar runs); `total`:
        what the bar's end counts (default: `progress` as it is now)."""
        from tqdm.auto import tqdm

        self.progress = progress
        self.start = time.perf_counter()
        self.shown = 0.0
        total = sum(p.duration for p in (progress if total is None else total))
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

    def __init__(
        self, engine: Any, max_active_files: int | None = None, pipeline_vad: bool = True
    ) -> None:
        """`max_active_files`: files decoded at once (default: twice max_num_seqs per engine core;
        each has one window in flight). `pipeline_vad`: batched files decode their first chunks
        while their VAD still runs (off: VAD first; the results are the same)."""
        self.engine = engine
        self.pipeline_vad = pipeline_vad
        self.builder = engine.input_processor.whisper_builder
        config = getattr(engine, "config", None)
        num_cores = config.parallel_config.data_parallel_size if config is not None else 1
        if max_active_files is None:
            max_num_seqs = config.scheduler_config.max_num_seqs if config is not None else 128
            max_active_files = 2 * max_num_seqs * num_cores
        self.max_active_files = max(1, max_active_files)
        self.files_per_step = num_cores * (
            config.encoder_budget_inputs if config is not None else 16
        )
        """Files started between two engine steps: one step's encoder budget of windows per
        engine core (data parallelism: each core steps on its own)."""
        self.num_cores = num_cores
        self.core_lead = 2 * self.files_per_step if getattr(engine, "core_runs_ahead", False) else 0
        """Windows kept queued ahead of a core that steps on its own (its own process): started
        windows without an output yet. Between two outputs such a core may run several steps;
        with only `files_per_step` started per output read, it ran short encoder steps and
        decoded in more, smaller batches (process_cost.py's step trace, session 20)."""
        self.first_files = num_cores * FIRST_FILES if self.core_lead else 1 << 30
        """Files a run sends alone before the rest of its first step budget (FIRST_FILES)."""

    def transcribe(
        self, audio: Any, *, use_tqdm: bool = False, lora_request: Any = None, **options: Any
    ) -> list[TranscriptionResult]:
        """One result per input, in order; `options` are `TranscriptionOptions` fields.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. Files advance
        window by window (each window depends on the one before); the windows of many files
        run in the same engine steps. Raises ValueError (AudioError for audio) on bad input
        before anything runs, and TranscriptionError if the engine fails a request.
        `lora_request`: the LoRA adapter every window runs with (None: the base model)."""
        stream = self.stream(audio, use_tqdm=use_tqdm, lora_request=lora_request, **options)
        return stream.results

    def stream(
        self, audio: Any, *, use_tqdm: bool = False, lora_request: Any = None, **options: Any
    ) -> TranscriptionStream:
        """As `transcribe`, but lazy: the returned `TranscriptionStream` yields each segment
        as soon as its window is decoded and runs the engine only while it is iterated
        (faster-whisper's `segments` generator). Options and audio are checked here, before
        anything runs."""
        if lora_request is not None:
            self.engine.input_processor.check_lora(lora_request)
        planner = TranscriptionPlanner(
            self.builder,
            TranscriptionOptions.from_kwargs(options),
            f"transcribe-{uuid.uuid4().hex}",
            lora_request=lora_request,
        )
        waveforms = load_audio_inputs(audio)
        if planner.options.batch_size is not None:
            job = self._batched(planner, waveforms, use_tqdm)
        else:
            job = self._sequential(planner, waveforms, use_tqdm)
        return TranscriptionStream(job)

    def _run(self, plans: list[Plan], max_active: int) -> _SyncRun:
        return _SyncRun(
            self.engine,
            plans,
            max_active,
            self.files_per_step,
            self.num_cores,
            self.core_lead,
            self.first_files,
        )

    def _sequential(
        self,
        planner: TranscriptionPlanner,
        waveforms: list[Any],
        use_tqdm: bool,
    ) -> _Job:
        """One plan per file, up to max_active_files at once."""
        units = [Unit(i) for i in range(len(waveforms))]
        progress = [
            FileProgress(w.shape[0] / SAMPLE_RATE, on_segment=u.queue.append)
            for w, u in zip(waveforms, units, strict=True)
        ]
        plans = [
            planner.plan(i, w, p) for i, (w, p) in enumerate(zip(waveforms, progress, strict=True))
        ]
        run = self._run(plans, self.max_active_files)
        for i, unit in enumerate(units):
            unit.is_done = functools.partial(_has_result, run.results, i)
        bar = ProgressBar(progress, show_progress(use_tqdm, progress))

        def steps() -> Iterator[None]:
            with contextlib.closing(run.steps()) as engine_steps:
                for _ in engine_steps:
                    bar.refresh()
                    yield

        def finish() -> list[TranscriptionResult]:
            assert all(r is not None for r in run.results)
            return run.results  # type: ignore[return-value]

        return _Job(units, steps(), finish, bar.close)

    def _batched(
        self,
        planner: TranscriptionPlanner,
        waveforms: list[Any],
        use_tqdm: bool,
    ) -> _Job:
        """batch_size: every file cut into chunks of at most 30 s (VAD speech with vad_filter,
        else plain 30 s pieces); the language detected once per file; all chunks of all files
        decoded as independent plans, batch_size at a time in the engine's steps, and each
        file's chunk results joined on its clock, chunk after chunk. The VAD runs on its
        threads meanwhile: a chunk is decoded as soon as no later VAD piece can change it
        (`pipeline_vad`; off, every file's VAD ends before the first chunk is decoded)."""
        feed = ChunkFeed(planner, waveforms, self.pipeline_vad)
        files = [FileProgress(w.shape[0] / SAMPLE_RATE) for w in waveforms]
        bar = ProgressBar(feed.progress, show_progress(use_tqdm, files), total=files)
        run = self._run([], planner.options.batch_size or 1)
        run.feed = feed
        feed.run = run

        def steps() -> Iterator[None]:
            with contextlib.closing(run.steps()) as engine_steps:
                for _ in engine_steps:
                    bar.refresh()
                    yield

        def close() -> None:
            feed.close()
            bar.close()

        return _Job(feed.units, steps(), feed.results, close)


def _has_result(results: list[Any], index: int) -> bool:
    return results[index] is not None


@dataclass
class _Job:
    """A started transcription: its plans in stream order, the engine steps that run them,
    and the results once they ran."""

    units: list[Unit]
    steps: Iterator[None]
    finish: Callable[[], list[TranscriptionResult]]
    close: Callable[[], None]


class TranscriptionStream:
    """Segments as they are decoded (`LLM.transcribe(..., stream=True)`): an iterator of
    `TranscriptionSegment` that runs the engine only while it is iterated, as faster-whisper's
    lazy `segments` generator. Each segment comes out as soon as its window is decoded, final
    (the same object the result holds); several inputs' segments come input by input, in
    order (`input_index` names the input of the last one). `results` (or `result`, for one
    input) runs whatever is left and returns what `transcribe` returns. Closing the stream
    early aborts the engine requests still running."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self._cursor = 0
        self._finished = False
        self._results: list[TranscriptionResult] | None = None
        self.input_index = 0
        """The input of the segment returned last."""

    def __iter__(self) -> TranscriptionStream:
        return self

    def __next__(self) -> TranscriptionSegment:
        job = self._job
        while True:
            while self._cursor < len(job.units):
                unit = job.units[self._cursor]
                if unit.queue:
                    segment = unit.queue.popleft()
                    if unit.place is not None:
                        unit.place(segment)
                    self.input_index = unit.input_index
                    return segment
                if not (self._finished or unit.is_done()):
                    break  # its next segment needs more engine steps
                self._cursor += 1
            if self._finished:
                raise StopIteration
            try:
                next(job.steps)
            except StopIteration:
                self._finished = True
                job.close()
            except BaseException:
                self._finished = True
                self._cursor = len(job.units)
                job.close()
                raise

    @property
    def results(self) -> list[TranscriptionResult]:
        """Every input's result, in order (runs the rest of the stream first)."""
        if self._results is None:
            for _ in self:
                pass
            self._results = self._job.finish()
        return self._results

    @property
    def result(self) -> TranscriptionResult:
        """The result of a stream of one input."""
        results = self.results
        if len(results) != 1:
            raise ValueError(f"the stream has {len(results)} inputs; read `results`")
        return results[0]

    def close(self) -> None:
        """Stops the stream: requests still running are aborted."""
        if not self._finished:
            self._finished = True
            self._cursor = len(self._job.units)
            close = getattr(self._job.steps, "close", None)
            try:
                if close is not None:
                    close()
            finally:
                self._job.close()

    def __enter__(self) -> TranscriptionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SyncRun:
    """Many files' plans over one synchronous engine: each file has one window in flight, and
    at most `max_active` files run at once; their windows share the engine's steps. Files
    start `files_per_step` (one step's encoder budget) between two steps, and one more before
    the first, so every step() has a step to launch before it reads back the last one
    (docs/decisions.md). With `lead` (a core that steps on its own), more files start after
    those, in a second message, until `lead` windows are queued without an output yet.
    `first_files`, when fewer than that first budget, go alone in a message before the rest
    of it (a core that steps on its own starts on them)."""

    def __init__(
        self,
        engine: Any,
        plans: list[Plan],
        max_active: int,
        files_per_step: int = 1 << 30,
        num_cores: int = 1,
        lead: int = 0,
        first_files: int = 1 << 30,
    ) -> None:
        self.engine = engine
        self.first_files = first_files
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
        self.feed: ChunkFeed | None = None
        """More plans while the run goes (batched files whose VAD still runs)."""
        self.lead = lead
        self.unanswered: set[str] = set()
        """Windows added that have no output yet (queued in the core, or in its steps)."""

    @property
    def num_plans(self) -> int:
        return len(self.plans)

    def _take_fed(self) -> None:
        """Adds the plans the feed has now; with nothing to run, waits for some."""
        assert self.feed is not None
        idle = not (self.pending or self.beams or self.waiting)
        plans = self.feed(idle)
        first = len(self.plans)
        self.plans.extend(plans)
        self.results.extend([None] * len(plans))
        self.waiting.extend(range(first, len(self.plans)))
        if idle and plans:
            self._start_waiting(extra=self.num_cores, first=True)  # as at the start of a run

    def run(self, on_progress: Callable[[], None]) -> list[TranscriptionResult]:
        for _ in self.steps():
            on_progress()
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def steps(self) -> Iterator[None]:
        """Runs the plans, yielding after each engine step (a lazy caller steps on demand);
        an error, or closing the iterator early, aborts every request still running."""
        engine = self.engine
        try:
            with deferred_full_collections():
                yield from self._steps()
        except BaseException:  # GeneratorExit included: a stream closed before its end
            if self.pending:
                engine.abort_request(list(self.pending))
            # The last step of each search: in flight, or held for forks.
            in_flight = take_step_request_ids([search for search, *_ in self.beams.values()])
            if in_flight:
                engine.abort_core_requests(in_flight)
            self.pending.clear()
            self.unanswered.clear()
            self.beams.clear()
            raise

    def _steps(self) -> Iterator[None]:
        engine = self.engine
        self._start_waiting(extra=self.num_cores, first=True)  # one unscheduled file per core
        while True:
            if self.feed is not None:
                self._take_fed()
            if not (self.pending or self.beams or self.waiting):
                if self.feed is None or self.feed.exhausted:
                    return
                continue
            for output in engine.step():
                entry = self.pending.get(output.request_id)
                if entry is None:
                    continue
                self.unanswered.discard(output.request_id)
                i, collector = entry
                collector.add(output)
                if output.finished:
                    del self.pending[output.request_id]
                    self._advance(i, collector.result())
            for req_id in list(self.beams):
                self._step_beam(req_id)
            self._start_waiting()
            yield

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
        if self.lead:
            self.unanswered.add(request.request_id)

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

    def _start_waiting(self, extra: int = 0, first: bool = False) -> None:
        """Starts up to one step's encoder budget of waiting files, and `extra` more (as
        `max_active` allows); `first` (a run's start): `first_files` of them alone first."""
        budget = self.files_per_step + extra
        if first and self.first_files < budget:
            with self.engine.batched_adds():  # the core's first encoder step waits for these
                self._start_files(self.first_files)
            budget -= self.first_files
        with self.engine.batched_adds():  # one message per core (2,048 clips under DP 4)
            self._start_files(budget)
        if self.lead and len(self.unanswered) < self.lead:
            with self.engine.batched_adds():  # a second message: the core starts on the first
                self._start_files(None)

    def _start_files(self, count: int | None) -> None:
        """Up to `count` files; None: until `lead` windows wait without an output."""
        started = 0
        while self.waiting and len(self.active) < self.max_active:
            if count is None and len(self.unanswered) >= self.lead:
                return
            if count is not None and started == count:
                return  # the rest after the next step (launched meanwhile)
            started += 1
            i = self.waiting.popleft()
            self.active.add(i)
            self._advance(i, None)
