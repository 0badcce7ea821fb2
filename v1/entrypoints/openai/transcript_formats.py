"""Transcription results as text, SubRip (srt), WebVTT (vtt) and OpenAI's json / verbose_json
bodies; shared by the server and `v1 transcribe`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from v1.entrypoints.openai.protocol import (
    TranscriptionResponse,
    TranscriptionSegmentOut,
    TranscriptionUsage,
    TranscriptionVerboseResponse,
    TranscriptionWordOut,
)


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS<marker>mmm (srt uses ",", vtt ".")."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{millis:03d}"


def to_srt(segments: Sequence[Any]) -> str:
    blocks = [
        f"{i}\n{format_timestamp(s.start, ',')} --> {format_timestamp(s.end, ',')}\n"
        f"{s.text.strip()}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(segments: Sequence[Any]) -> str:
    blocks = [
        f"{format_timestamp(s.start, '.')} --> {format_timestamp(s.end, '.')}\n{s.text.strip()}\n"
        for s in segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def word_cues(segments: Sequence[Any]) -> list[Any]:
    """One cue per word (srt/vtt with word timestamps): objects with start, end and text."""
    from types import SimpleNamespace

    return [
        SimpleNamespace(start=w.start, end=w.end, text=w.word)
        for s in segments
        for w in (s.words or [])
    ]


def to_tsv(segments: Sequence[Any]) -> str:
    """openai-whisper's tsv: start and end in integer milliseconds, then the text."""
    lines = ["start\tend\ttext"]
    for s in segments:
        text = s.text.strip().replace("\t", " ")
        lines.append(f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{text}")
    return "\n".join(lines) + "\n"


def language_name(code: str) -> str:
    """Whisper's English name of an ISO code ("en" -> "english"); the code when unknown."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def usage(duration: float) -> TranscriptionUsage:
    return TranscriptionUsage(seconds=math.ceil(duration))


def to_json(result: Any) -> TranscriptionResponse:
    return TranscriptionResponse(text=result.text, usage=usage(result.duration))


def to_verbose_json(
    result: Any, task: str, with_segments: bool = True, with_words: bool = False
) -> TranscriptionVerboseResponse:
    """OpenAI's verbose_json body; each segment reports the seek and temperature of the
    window decoding it came from. Words (a result transcribed with word_timestamps) are
    written as OpenAI does: without their leading space."""
    segments = None
    if with_segments:
        segments = [
            TranscriptionSegmentOut(
                id=s.id,
                seek=s.seek,
                start=s.start,
                end=s.end,
                text=s.text,
                tokens=list(s.tokens),
                temperature=s.temperature,
                avg_logprob=s.avg_logprob if math.isfinite(s.avg_logprob) else None,
                compression_ratio=s.compression_ratio,
                no_speech_prob=s.no_speech_prob,
            )
            for s in result.segments
        ]
    return TranscriptionVerboseResponse(
        task=task,  # type: ignore[arg-type]
        language=language_name(result.language),
        duration=round(result.duration, 3),
        text=result.text,
        segments=segments,
        words=_words(result) if with_words else None,
        usage=usage(result.duration),
    )


def _words(result: Any) -> list[TranscriptionWordOut]:
    if result.words is None:
        raise ValueError("the transcription was made without word_timestamps")
    return [
        TranscriptionWordOut(
            word=w.word.strip(),
            start=w.start,
            end=w.end,
            probability=getattr(w, "probability", None),
        )
        for w in result.words
    ]
