"""Long audio in consecutive chunks -> one transcription: the server's long-audio path.

`chunk_events` runs each chunk through an `AsyncTranscriber` after the one before (the first
chunk's language holds for the rest, the prompt for the first only; clip_timestamps' spans go
to the chunks they reach into); `ChunkMerger` joins the chunks' results on the file's clock.
Chunks shorter than Whisper's minimum, or outside every clip span, are skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np

from v1.audio import MIN_AUDIO_SECONDS, SAMPLE_RATE
from v1.engine.transcription.plan import TranscriptionPlanner
from v1.engine.transcription.segments import TranscriptionResult, TranscriptionSegment
from v1.engine.transcription.streaming import AsyncTranscriber, InputDone, TranscriptionEvent
from v1.engine.transcription.words import TranscriptionWord


class ChunkMerger:
    """TranscriptionResults of consecutive chunks as one: segment times shifted by the chunk's
    offset and renumbered, texts joined (each starts with its own space, as Whisper writes)."""

    def __init__(self) -> None:
        self.num_chunks = 0
        self.num_samples = 0
        self.language: str | None = None
        self.texts: list[str] = []
        self.segments: list[TranscriptionSegment] = []
        self.words: list[TranscriptionWord] | None = None

    def add(self, result: TranscriptionResult, num_samples: int) -> None:
        offset = self.num_samples / SAMPLE_RATE
        for seg in result.segments:
            seg.id = len(self.segments)
            seg.start = round(seg.start + offset, 3)
            seg.end = round(seg.end + offset, 3)
            self.segments.append(seg)
        if result.words is not None:
            self.words = self.words or []
            for word in result.words:
                word.start = round(word.start + offset, 3)
                word.end = round(word.end + offset, 3)
                self.words.append(word)
        self.texts.append(result.text)
        self.language = self.language or result.language
        self.num_chunks += 1
        self.num_samples += num_samples

    def skip(self, num_samples: int) -> None:
        self.num_samples += num_samples

    def result(self) -> TranscriptionResult:
        return TranscriptionResult(
            text="".join(self.texts),
            language=self.language or "en",
            duration=self.num_samples / SAMPLE_RATE,
            segments=self.segments,
            words=self.words,
        )


async def chunk_events(
    transcriber: AsyncTranscriber,
    planner: TranscriptionPlanner,
    first: np.ndarray,
    chunks: AsyncIterator[np.ndarray],
    request_id: str,
    merged: ChunkMerger,
) -> AsyncIterator[TranscriptionEvent]:
    """The transcriber's events over `first` and then `chunks`, one chunk after another, each
    chunk's result merged into `merged`. The planner's requests of chunk k are under
    f"{request_id}-{k}" (the planner itself was prepared with f"{request_id}-0")."""
    chunk: np.ndarray | None = first
    while chunk is not None:
        offset = merged.num_samples / SAMPLE_RATE
        clipped = planner.clipped(offset, offset + chunk.shape[0] / SAMPLE_RATE)
        if chunk.shape[0] < MIN_AUDIO_SECONDS * SAMPLE_RATE or clipped is None:
            merged.skip(chunk.shape[0])  # too short, or outside every clip_timestamps span
        else:
            chunk_planner = clipped
            if merged.language is not None:
                prefix = f"{request_id}-{merged.num_chunks}"
                chunk_planner = clipped.continued(merged.language, prefix)
            events = transcriber.events(chunk_planner, [chunk])
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, InputDone):
                        merged.add(event.result, chunk.shape[0])
                    yield event
        chunk = await anext(chunks, None)
