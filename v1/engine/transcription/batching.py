"""A batched file (faster-whisper's `BatchedInferencePipeline`, `batch_size`): its chunks of at
most 30 s (VAD speech, or plain pieces), decoded on their own, then joined on the file's clock
chunk after chunk. Both drivers (`offline.py`, `streaming.py`) use these.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from v1.audio import SAMPLE_RATE
from v1.audio.vad import VadOptions, get_speech_timestamps
from v1.engine.inputs.whisper import WINDOW_SECONDS
from v1.engine.transcription.plan import TranscriptionResult, TranscriptionSegment


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


class ChunkJoiner:
    """The chunks of one batched file on the file's clock, chunk after chunk: `place` shifts
    a chunk's segment (ids, times, seek, words) as it comes, `result` joins the chunks'
    results."""

    def __init__(self, duration: float, with_words: bool) -> None:
        self.duration = duration
        self.with_words = with_words
        self.segments: list[TranscriptionSegment] = []
        self.last_end = 0.0

    def place(self, offset: float, seg: TranscriptionSegment) -> None:
        seg.id = len(self.segments)
        seg.start = round(max(seg.start + offset, self.last_end), 3)
        seg.end = round(max(seg.end + offset, seg.start), 3)
        seg.seek += round(offset * 100)
        self.last_end = seg.end
        for word in seg.words or []:
            word.start = round(word.start + offset, 3)
            word.end = round(word.end + offset, 3)
        self.segments.append(seg)

    def result(
        self,
        parts: list[TranscriptionResult],
        language: tuple[str | None, float | None],
        default_language: str,
    ) -> TranscriptionResult:
        """The file's result from its chunks' results (in time order, each segment placed)."""
        code, probability = language
        if code is None and parts:
            code, probability = parts[0].language, parts[0].language_probability
        return TranscriptionResult(
            text="".join(r.text for r in parts),
            language=code or default_language,
            duration=self.duration,
            segments=self.segments,
            words=[w for s in self.segments for w in s.words or []] if self.with_words else None,
            language_probability=probability,
        )
