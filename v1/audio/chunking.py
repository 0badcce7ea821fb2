"""Long-form audio: fixed 30-second windows and Whisper timestamp-token segment math.

Pure functions, no model: `split_windows` cuts a waveform into consecutive windows, and
`timestamp_segments` turns one window's generated `<|t|> text <|t|>` tokens into absolute
(start, end, token_ids) segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from v1.audio.clip import AudioClip

WHISPER_TIME_PRECISION = 0.02
"""Seconds per Whisper timestamp step: `<|1.00|>` is `timestamp_begin + 50`."""


@dataclass(frozen=True, eq=False)
class AudioWindow:
    """One window of a long recording."""

    offset_seconds: float
    """Start of the window in the whole recording."""
    samples: np.ndarray
    """The window's samples (a view into the recording, not a copy)."""
    sample_rate: int = 16_000

    @property
    def duration_seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate

    @cached_property
    def clip(self) -> AudioClip:
        """The window as one encoder input (16 kHz float32 windows only): every request made
        from the same window shares this clip, so its content hash is computed once."""
        if self.sample_rate != 16_000:
            raise ValueError(f"an AudioClip is 16 kHz audio; this window is {self.sample_rate} Hz")
        return AudioClip(self.samples)


@dataclass(frozen=True)
class Segment:
    """Text tokens between two timestamps, in seconds from the start of the recording."""

    start: float
    end: float
    token_ids: list[int]


def split_windows(audio: np.ndarray, sr: int = 16_000, window_s: float = 30.0) -> list[AudioWindow]:
    """Consecutive `window_s` windows covering `audio` ([frames]); the last may be shorter.

    Empty audio gives no windows.
    """
    if audio.ndim != 1:
        raise ValueError(f"audio must be 1-D (mono), got shape {audio.shape}")
    if sr <= 0 or window_s <= 0:
        raise ValueError(f"sample rate and window length must be positive, got {sr}, {window_s}")
    window_frames = round(window_s * sr)
    if window_frames < 1:
        raise ValueError(f"a {window_s} s window at {sr} Hz holds no samples")
    return [
        AudioWindow(
            offset_seconds=start / sr, samples=audio[start : start + window_frames], sample_rate=sr
        )
        for start in range(0, audio.shape[0], window_frames)
    ]


def timestamp_to_seconds(
    token_id: int, timestamp_begin: int, time_precision: float = WHISPER_TIME_PRECISION
) -> float:
    """Seconds from the window start of a timestamp token (`timestamp_begin` is `<|0.00|>`)."""
    return (token_id - timestamp_begin) * time_precision


def timestamp_segments(
    token_ids: Sequence[int],
    *,
    timestamp_begin: int,
    offset_seconds: float = 0.0,
    window_seconds: float = 30.0,
    time_precision: float = WHISPER_TIME_PRECISION,
    eos_token_id: int | None = None,
) -> list[Segment]:
    """Segments of one window's generated tokens, with `offset_seconds` added to every time.

    Ids >= `timestamp_begin` are timestamps, others text (pass tokens after the prompt; parsing
    stops at `eos_token_id`). `<|a|> text <|b|>` is a segment [a, b]; a timestamp right after
    a closed segment opens the next one. Text with no closing timestamp ends at
    `window_seconds`; text before the first timestamp starts at 0 (or at the previous end).
    No timestamps at all: one segment covering the window. No text: no segments.
    """
    segments: list[Segment] = []
    start: float | None = None  # open segment's start (window time)
    last_end = 0.0
    text: list[int] = []

    def close(end: float) -> None:
        begin = last_end if start is None else start
        segments.append(
            Segment(offset_seconds + begin, offset_seconds + max(end, begin), list(text))
        )

    for token_id in token_ids:
        if eos_token_id is not None and token_id == eos_token_id:
            break
        if token_id < timestamp_begin:
            text.append(token_id)
            continue
        time = timestamp_to_seconds(token_id, timestamp_begin, time_precision)
        if text:
            close(time)
            text.clear()
            start, last_end = None, max(time, last_end)
        else:
            start = time  # opens a segment; of `<|a|><|b|>` with no text between, b wins
    if text:
        close(max(window_seconds, last_end if start is None else start))
    return segments
