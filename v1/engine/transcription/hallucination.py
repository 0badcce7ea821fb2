"""hallucination_silence_threshold: openai-whisper's hallucination score of a segment's words
and the rule faster-whisper's `generate_segments` applies with it to one decoded window (drop a
hallucination between silences, decode again after a long silence, seek to the last word)."""

from __future__ import annotations

import string
from dataclasses import dataclass

from v1.engine.transcription.seek import FRAMES_PER_SECOND, WINDOW_FRAMES
from v1.engine.transcription.words import TranscriptionWord

Span = tuple[float, float, list[int]]
"""A segment of a window: (start, end, text token ids)."""


@dataclass(frozen=True)
class WindowPlace:
    """A decoded window's place in its file, in frames."""

    seek: int
    size: int
    """Frames the window decoded."""
    num_frames: int
    """Frames of the whole file."""


def is_anomaly(words: list[TranscriptionWord]) -> bool:
    """openai-whisper's hallucination score of a segment's first 8 words (very short, very
    long or improbable words)."""
    scored = [w for w in words if w.word.strip() not in string.punctuation][:8]
    score = 0.0
    for w in scored:
        if (w.probability if w.probability is not None else 1.0) < 0.15:
            score += 1.0
        duration = w.end - w.start
        if duration < 0.133:
            score += (0.133 - duration) * 15
        if duration > 2.0:
            score += duration - 2.0
    return score >= 3 or score + 0.01 >= len(scored)


def skip_hallucinations(
    spans: list[Span],
    seg_words: list[list[TranscriptionWord]],
    place: WindowPlace,
    next_seek: int,
    *,
    threshold: float,
    last_speech: float,
    single_ending: bool,
) -> tuple[list[Span], int, float | None, bool]:
    """(kept spans, next seek, end of the last kept word, whether the window is decoded
    again) for a window's spans and their timed words (`seg_words`, one list a span), given
    the end of the last word decoded before it (`last_speech`) and whether its tokens end on
    a single timestamp. A window not ending so seeks to its last word's end; one whose first
    worded segment looks hallucinated after a silence longer than the threshold is decoded
    again from after that silence; a hallucination-like segment with silence (or
    hallucinations) on both sides ends the window there (it and what follows are dropped)."""
    seek = place.seek
    offset = seek / FRAMES_PER_SECOND
    word_ends = [words[-1].end for words in seg_words if words]
    if not single_ending and word_ends and word_ends[-1] > offset:
        next_seek = round(word_ends[-1] * FRAMES_PER_SECOND)
    window_end = (seek + WINDOW_FRAMES) / FRAMES_PER_SECOND
    first = next((words for words in seg_words if words), None)
    if first is not None and is_anomaly(first):
        gap = first[0].start - offset
        if gap > threshold:
            return [], seek + round(gap * FRAMES_PER_SECOND), None, True
    last_end = last_speech
    for si, words in enumerate(seg_words):
        if not words:
            continue
        if is_anomaly(words):
            following = next((w for w in seg_words[si + 1 :] if w), None)
            next_start = (
                following[0].start if following else offset + place.size / FRAMES_PER_SECOND
            )
            start, end = words[0].start, words[-1].end
            silence_before = (
                start - last_end > threshold or start < threshold or start - offset < 2.0
            )
            silence_after = (
                next_start - end > threshold
                or (following is not None and is_anomaly(following))
                or window_end - end < 2.0
            )
            if silence_before and silence_after:
                new_seek = round(max(offset + 1, start) * FRAMES_PER_SECOND)
                if place.num_frames / FRAMES_PER_SECOND - end < threshold:
                    new_seek = place.num_frames
                kept_ends = [w[-1].end for w in seg_words[:si] if w]
                return (
                    spans[:si],
                    max(new_seek, seek + 1),
                    kept_ends[-1] if kept_ends else None,
                    False,
                )
        last_end = words[-1].end
    return spans, next_seek, word_ends[-1] if word_ends else None, False
