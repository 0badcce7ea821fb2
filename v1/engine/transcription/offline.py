"""`Transcriber`: Whisper transcription over the synchronous `LLMEngine` (the offline `LLM`).

Many files' plans share the engine's steps, each file with one window in flight; files start
one step's encoder budget at a time (plus one, so a pipelined step always has work queued).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from v1.audio import SAMPLE_RATE
from v1.audio.vad import VadOptions, get_speech_timestamps
from v1.engine.beam_search import (
    BeamSearch,
    advance_beam_searches,
    beam_step_requests,
    take_step_request_ids,
)
from v1.engine.inputs.whisper import WINDOW_SECONDS
from v1.engine.transcription.loading import load_audio_inputs
from v1.engine.transcription.plan import (
    FileProgress,
    Plan,
    TranscriptionOptions,
    TranscriptionPlanner,
    TranscriptionResult,
    TranscriptionSegment,
    WindowOutput,
)
from v1.engine.transcription.windows import (
    WindowCollector,
    advance_plan,
    beam_window_output,
    window_beam_search,
)
from v1.engine.transcription.words import TranscriptionWord
from v1.gc_policy import deferred_full_collections


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
        self, audio: Any, *, use_tqdm: bool = False, lora_request: Any = None, **options: Any
    ) -> list[TranscriptionResult]:
        """One result per input, in order; `options` are `TranscriptionOptions` fields.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. Files advance
        window by window (each window depends on the one before); the windows of many files
        run in the same engine steps. Raises ValueError (AudioError for audio) on bad input
        before anything runs, and TranscriptionError if the engine fails a request.
        `lora_request`: the LoRA adapter every window runs with (None: the base model)."""
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
            return self._batched(planner, waveforms, use_tqdm)
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

    def _batched(
        self, planner: TranscriptionPlanner, waveforms: list[Any], use_tqdm: bool
    ) -> list[TranscriptionResult]:
        """batch_size: every file cut into chunks of at most 30 s (VAD speech with vad_filter,
        else plain 30 s pieces); the language detected once per file; then all chunks of all
        files decoded as independent plans, batch_size at a time in the engine's steps, and
        each file's chunk results merged on its clock."""
        options = planner.options
        batch_size = options.batch_size
        assert batch_size is not None
        chunks = [
            speech_chunks(w, options.vad_parameters if options.vad_filter else None)
            for w in waveforms
        ]
        languages: list[tuple[str | None, float | None]] = [
            (planner.language, 1.0 if planner.language else None)
        ] * len(waveforms)
        detect = planner.tokens.multilingual and planner.language is None
        if detect and not options.multilingual:
            todo = [i for i, c in enumerate(chunks) if c]
            plans = [
                planner.detect_plan(i, waveforms[i][chunks[i][0][0] : chunks[i][0][1]])
                for i in todo
            ]
            found = _SyncRun(self.engine, plans, batch_size, self.files_per_step, self.num_cores)
            for i, lang in zip(todo, found.run(lambda: None), strict=True):
                languages[i] = lang  # type: ignore[assignment]
        plans, owners, progress = [], [], []
        for i, (w, file_chunks) in enumerate(zip(waveforms, chunks, strict=True)):
            chunk_planner = planner.for_chunks(languages[i][0])
            for k, (start, end) in enumerate(file_chunks):
                p = FileProgress((end - start) / SAMPLE_RATE)
                chunk_planner_k = chunk_planner
                if k:
                    chunk_planner_k = copy.copy(chunk_planner)
                    chunk_planner_k.prefix_ids = []  # the prefix starts the file only
                plans.append(chunk_planner_k.plan(len(plans), w[start:end], p))
                owners.append((i, start))
                progress.append(p)
        bar = ProgressBar(progress, show_progress(use_tqdm, progress))
        try:
            run = _SyncRun(self.engine, plans, batch_size, self.files_per_step, self.num_cores)
            chunk_results = run.run(bar.refresh)
        finally:
            bar.close()
        merged = []
        for i, w in enumerate(waveforms):
            parts = [
                (start, r)
                for (owner, start), r in zip(owners, chunk_results, strict=True)
                if owner == i
            ]
            merged.append(
                merge_chunk_results(
                    parts,
                    w.shape[0] / SAMPLE_RATE,
                    languages[i],
                    planner.language or "en",
                    options.word_timestamps,
                )
            )
        return merged


def speech_chunks(
    samples: Any, vad: VadOptions | None, max_seconds: float = WINDOW_SECONDS
) -> list[tuple[int, int]]:
    """(start, end) samples of the chunks of a batched file, each at most `max_seconds`: VAD
    speech spans (split at `max_seconds`) joined while they fit one chunk, from the first
    span's start to the last one's end (the silence between stays in); without VAD, plain
    consecutive pieces."""
    limit = int(max_seconds * SAMPLE_RATE)
    n = samples.shape[0]
    if vad is None:
        return [(s, min(s + limit, n)) for s in range(0, n, limit)]
    vad = dataclasses.replace(
        vad, max_speech_duration_s=min(vad.max_speech_duration_s, max_seconds)
    )
    chunks: list[tuple[int, int]] = []
    for start, end in get_speech_timestamps(samples, vad):
        end = min(end, start + limit)
        if chunks and end - chunks[-1][0] <= limit:
            chunks[-1] = (chunks[-1][0], end)
        else:
            chunks.append((start, end))
    return chunks


def merge_chunk_results(
    parts: list[tuple[int, TranscriptionResult]],
    duration: float,
    language: tuple[str | None, float | None],
    default_language: str,
    with_words: bool,
) -> TranscriptionResult:
    """The chunks of one file (start sample, result) as one result on the file's clock."""
    segments: list[TranscriptionSegment] = []
    words: list[TranscriptionWord] = []
    texts: list[str] = []
    last_end = 0.0
    for start, result in sorted(parts, key=lambda p: p[0]):
        offset = start / SAMPLE_RATE
        for seg in result.segments:
            seg.id = len(segments)
            seg.start = round(max(seg.start + offset, last_end), 3)
            seg.end = round(max(seg.end + offset, seg.start), 3)
            seg.seek += round(offset * 100)
            last_end = seg.end
            for word in seg.words or []:
                word.start = round(word.start + offset, 3)
                word.end = round(word.end + offset, 3)
                words.append(word)
            segments.append(seg)
        texts.append(result.text)
    code, probability = language
    if code is None and parts:
        code = sorted(parts, key=lambda p: p[0])[0][1].language
        probability = sorted(parts, key=lambda p: p[0])[0][1].language_probability
    return TranscriptionResult(
        text="".join(texts),
        language=code or default_language,
        duration=duration,
        segments=segments,
        words=words if with_words else None,
        language_probability=probability,
    )


class _SyncRun:
    """Many files' plans over one synchronous engine: each file has one window in flight, and
    at most `max_active` files run at once; their windows share the engine's steps. Files
    start `files_per_step` (one step's encoder budget) between two steps, and one more before
    the first, so every step() has a step to launch before it reads back the last one
    (docs/decisions.md)."""

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
