"""The chunk plans of batched files (`batch_size`): each file cut into chunks as its VAD settles
them, its language detected once, and the chunks' results joined on the file's clock; fed to
the `Transcriber`'s run as the chunks come."""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from v1.audio import SAMPLE_RATE
from v1.engine.transcription.batching import ChunkJoiner, ChunkStream
from v1.engine.transcription.plan import TranscriptionPlanner
from v1.engine.transcription.plan_io import FileProgress, Plan
from v1.engine.transcription.segments import TranscriptionResult, TranscriptionSegment


@dataclass
class Unit:
    """One plan in stream order (a file, or a chunk of a batched file): the segments it has
    decoded and not yet handed on, and how they go onto their file's clock."""

    input_index: int
    place: Callable[[TranscriptionSegment], None] | None = None
    """Puts a segment on its file's clock, in place (chunks of a batched file)."""
    queue: deque[TranscriptionSegment] = dataclasses.field(default_factory=deque)
    is_done: Callable[[], bool] = lambda: False
    """The plan has returned (every segment of it is in the queue)."""


class PlanRun(Protocol):
    """What the feed reads of the run it feeds: how many plans it holds and their results
    (None while a plan runs)."""

    results: list[Any]

    @property
    def num_plans(self) -> int: ...


class ChunkFeed:
    """The chunk plans of batched files, handed to a `_SyncRun` as the files' VAD settles
    their chunks: files in order, each file's chunks in order (the stream order of `units`).
    A file whose language is detected first (multilingual model, no language) runs its
    detection plan on its first chunk, and its chunk plans once that plan has returned."""

    def __init__(
        self, planner: TranscriptionPlanner, waveforms: list[Any], pipelined: bool
    ) -> None:
        options = planner.options
        self.planner = planner
        self.waveforms = waveforms
        self.pipelined = pipelined
        vad = options.vad_parameters if options.vad_filter else None
        self.chunks = [ChunkStream(w, vad) for w in waveforms]
        self.detect = planner.tokens.multilingual and planner.language is None
        self.detect = self.detect and not options.multilingual
        self.languages: list[tuple[str | None, float | None]] = [
            (planner.language, 1.0 if planner.language else None)
        ] * len(waveforms)
        self.joiners = [
            ChunkJoiner(w.shape[0] / SAMPLE_RATE, options.word_timestamps) for w in waveforms
        ]
        self.units: list[Unit] = []
        self.progress: list[FileProgress] = []
        self.spans: list[tuple[int, int, int]] = []
        """(file, start, end sample) of each chunk, in stream order."""
        self.plan_of_chunk: list[int | None] = []
        """The run's plan index of each chunk (None until its plan is made)."""
        self.detecting: dict[int, int] = {}
        """File -> the run's plan index of its language detection, while it runs."""
        self.held: list[int] = []
        """Chunks waiting for their file's language, in stream order."""
        self.file = 0  # the file whose chunks are read now
        self.last_end = [0] * len(waveforms)  # each file's end of its last chunk (samples)
        self.run: PlanRun | None = None

    @property
    def exhausted(self) -> bool:
        """Nothing more will come."""
        return self.file == len(self.chunks) and not self.held and not self.detecting

    def __call__(self, idle: bool) -> list[Plan]:
        """The plans that can start now; `idle` (the engine has nothing to run): waits for the
        next VAD piece rather than return nothing."""
        plans: list[Plan] = []
        if not self.pipelined:
            for source in self.chunks[self.file :]:
                source.wait()  # every file's VAD, then its spans and chunks at once
            self._read(wait=False, plans=plans)
            assert self.file == len(self.chunks)
        else:
            self._read(wait=idle, plans=plans)
        self._release(plans)
        while idle and not plans and self.file < len(self.chunks) and not self.detecting:
            self._read(wait=True, plans=plans)  # the pieces read so far settled no chunk
            self._release(plans)
        return plans

    def _read(self, wait: bool, plans: list[Plan]) -> None:
        """Reads settled chunks of the current file (and of the files after it, once it is
        done)."""
        while self.file < len(self.chunks):
            i = self.file
            source = self.chunks[i]
            for start, end in source.take(wait):
                self._add_chunk(i, start, end, plans)
                wait = False
            if not source.done:
                return
            self._end_file(i)
            self.file += 1
            wait = False

    def _add_chunk(self, i: int, start: int, end: int, plans: list[Plan]) -> None:
        k = len(self.units)
        first_of_file = not self.spans or self.spans[-1][0] != i
        unit = Unit(i, functools.partial(self.joiners[i].place, start / SAMPLE_RATE))
        unit.is_done = functools.partial(self._chunk_done, k)
        self.units.append(unit)
        self.spans.append((i, start, end))
        # The bar counts the file's seconds: a chunk, the silence before it.
        self.progress.append(
            FileProgress((end - self.last_end[i]) / SAMPLE_RATE, on_segment=unit.queue.append)
        )
        self.last_end[i] = end
        self.plan_of_chunk.append(None)
        self.held.append(k)
        if first_of_file and self.detect:
            assert self.run is not None
            waveform = self.waveforms[i]
            self.detecting[i] = self.run.num_plans + len(plans)
            plans.append(self.planner.detect_plan(i, waveform[start:end]))

    def _end_file(self, i: int) -> None:
        tail = self.waveforms[i].shape[0] - self.last_end[i]
        self.progress.append(FileProgress(tail / SAMPLE_RATE, done=tail / SAMPLE_RATE))

    def _release(self, plans: list[Plan]) -> None:
        """Chunk plans of the held chunks whose file's language is known, in stream order."""
        assert self.run is not None
        for i, index in list(self.detecting.items()):
            found = self.run.results[index] if index < len(self.run.results) else None
            if found is not None:
                self.languages[i] = found  # type: ignore[assignment]
                del self.detecting[i]
        still: list[int] = []
        for k in self.held:
            i, start, end = self.spans[k]
            if i in self.detecting:
                still.append(k)
                continue
            chunk_planner = self.planner.for_chunks(self.languages[i][0])  # a copy
            if k and self.spans[k - 1][0] == i:
                chunk_planner.prefix_ids = []  # the prefix starts the file only
            self.plan_of_chunk[k] = self.run.num_plans + len(plans)
            plans.append(chunk_planner.plan(k, self.waveforms[i][start:end], self.progress[k]))
        self.held = still

    def _chunk_done(self, k: int) -> bool:
        index = self.plan_of_chunk[k]
        return index is not None and self.run is not None and self.run.results[index] is not None

    def results(self) -> list[TranscriptionResult]:
        """Each file's result: its chunks' results joined (once every plan has run)."""
        assert self.run is not None and self.exhausted
        parts: list[list[TranscriptionResult]] = [[] for _ in self.waveforms]
        for (i, _, _), index in zip(self.spans, self.plan_of_chunk, strict=True):
            assert index is not None
            parts[i].append(self.run.results[index])  # type: ignore[arg-type]
        return [
            joiner.result(part, language, self.planner.language or "en")
            for joiner, part, language in zip(self.joiners, parts, self.languages, strict=True)
        ]

    def close(self) -> None:
        for source in self.chunks:
            source.close()
