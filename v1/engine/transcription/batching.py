"""A batched file (faster-whisper's `BatchedInferencePipeline`, `batch_size`): its chunks of at
most 30 s (VAD speech, or plain pieces), decoded on their own, then joined on the file's clock
chunk after chunk. Both drivers (`offline.py`, `streaming.py`) use these; `ChunkStream` hands a
file's chunks out while its VAD still runs, so the offline driver decodes the first ones
meanwhile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from v1.audio import SAMPLE_RATE
from v1.audio.vad import SpanStream, VadOptions, get_speech_timestamps
from v1.engine.inputs.whisper import WINDOW_SECONDS
from v1.engine.transcription.segments import TranscriptionResult, TranscriptionSegment


def chunk_vad_options(vad: VadOptions, max_seconds: float = WINDOW_SECONDS) -> VadOptions:
    """The VAD options a batched file runs with: no span longer than a chunk."""
    return dataclasses.replace(
        vad, max_speech_duration_s=min(vad.max_speech_duration_s, max_seconds)
    )


class ChunkBuilder:
    """Speech spans -> chunks of at most `max_seconds`, as the spans come: a span (cut at
    `max_seconds`) joins the open chunk while the chunk still fits, from its first span's
    start to its last one's end (the silence between stays in); a span that does not fit
    closes the open chunk, which can then no longer change."""

    def __init__(self, max_seconds: float = WINDOW_SECONDS) -> None:
        self.limit = int(max_seconds * SAMPLE_RATE)
        self._open: tuple[int, int] | None = None

    def add(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The chunks that `spans` (the next ones of the file, in order) closed."""
        closed: list[tuple[int, int]] = []
        for start, end in spans:
            end = min(end, start + self.limit)
            if self._open is not None and end - self._open[0] <= self.limit:
                self._open = (self._open[0], end)
            else:
                if self._open is not None:
                    closed.append(self._open)
                self._open = (start, end)
        return closed

    def finish(self) -> list[tuple[int, int]]:
        """The open chunk, at the end of the file."""
        last, self._open = self._open, None
        return [last] if last is not None else []


def speech_chunks(
    samples: Any, vad: VadOptions | None, max_seconds: float = WINDOW_SECONDS
) -> list[tuple[int, int]]:
    """(start, end) samples of the chunks of a batched file, each at most `max_seconds`
    (`ChunkBuilder` over the VAD speech spans); without VAD, plain consecutive pieces."""
    limit = int(max_seconds * SAMPLE_RATE)
    n = samples.shape[0]
    if vad is None:
        return [(s, min(s + limit, n)) for s in range(0, n, limit)]
    builder = ChunkBuilder(max_seconds)
    chunks = builder.add(get_speech_timestamps(samples, chunk_vad_options(vad, max_seconds)))
    return chunks + builder.finish()


class ChunkStream:
    """One batched file's chunks as its VAD settles them (`SpanStream` -> `ChunkBuilder`):
    `take` hands out, in order, the chunks no later VAD piece can change; without VAD, every
    chunk at once. Once `done`, the chunks handed out are exactly `speech_chunks` over the
    same VAD probabilities."""

    def __init__(
        self, samples: Any, vad: VadOptions | None, max_seconds: float = WINDOW_SECONDS
    ) -> None:
        self._spans: SpanStream | None = None
        self._plain: list[tuple[int, int]] = []
        if vad is None:
            self._plain = speech_chunks(samples, None, max_seconds)
        else:
            self._spans = SpanStream(samples, chunk_vad_options(vad, max_seconds))
            self._builder = ChunkBuilder(max_seconds)

    @property
    def done(self) -> bool:
        """Every chunk is handed out."""
        return not self._plain and (self._spans is None or self._spans.done)

    def take(self, wait: bool = False) -> list[tuple[int, int]]:
        """The chunks settled since the last call; `wait`: first waits for the next VAD piece."""
        if self._spans is None:
            chunks, self._plain = self._plain, []
            return chunks
        if self._spans.done:
            return []
        chunks = self._builder.add(self._spans.take(wait))
        if self._spans.done:
            chunks += self._builder.finish()
        return chunks

    def wait(self) -> None:
        """Waits until the file's VAD has finished (the next `take` hands out every chunk)."""
        if self._spans is not None:
            self._spans.wait()

    def close(self) -> None:
        if self._spans is not None:
            self._spans.close()


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
