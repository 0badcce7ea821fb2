"""Whisper's long-form decoding rules, model-free (openai-whisper's `transcribe`): where the next
30 s window starts (seek), the segments of one window's tokens, and the temperature-fallback
verdict on a decoded window, for the plan (`plan.py`) and anything else decoding windows.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SAMPLES_PER_FRAME = 160
"""Log-mel hop at 16 kHz: seek positions are counted in these 10 ms frames."""
FRAMES_PER_SECOND = 100
WINDOW_FRAMES = 3000
"""Frames of one 30 s encoder window."""
FRAMES_PER_TIMESTAMP = 2
"""One timestamp step (0.02 s, `<|0.02|>`) is two frames (the encoder's input stride)."""
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
MAX_CONDITIONING_TEMPERATURE = 0.5
"""A window decoded hotter than this does not prompt the next one (openai-whisper)."""


# ---- seek and segments ----
@dataclass(frozen=True)
class WindowSegment:
    """One `<|a|> text <|b|>` segment of a window, in frames from the start of the audio."""

    start_frame: int
    end_frame: int
    token_ids: list[int]
    """The segment's tokens with its timestamps, as the next window's prompt takes them."""

    @property
    def start(self) -> float:
        return self.start_frame / FRAMES_PER_SECOND

    @property
    def end(self) -> float:
        return self.end_frame / FRAMES_PER_SECOND


def seek_window(
    token_ids: Sequence[int], *, seek: int, num_frames: int, timestamp_begin: int
) -> tuple[list[WindowSegment], int]:
    """(segments, next seek) of one window that starts at frame `seek`, spans `num_frames`
    frames and generated `token_ids` (after its prompt, without EOS).

    Consecutive timestamps `<|b|><|b|>` close one segment and open the next. A window that ends
    on one timestamp after text (or has no pair at all) is done: the next window starts at its
    end. Otherwise the text after the last pair is a segment cut by the window edge: it is
    dropped and the next window starts at that last pair's time, so that it is decoded again
    whole (openai-whisper and transformers agree on all of this).
    """
    tokens = list(token_ids)
    is_time = [t >= timestamp_begin for t in tokens]

    def frame(token_id: int) -> int:
        return seek + (token_id - timestamp_begin) * FRAMES_PER_TIMESTAMP

    single_ending = is_time[-2:] == [False, True]
    pairs = [i + 1 for i in range(len(tokens) - 1) if is_time[i] and is_time[i + 1]]
    if not pairs:
        times = [t for t, timed in zip(tokens, is_time, strict=True) if timed]
        end = seek + num_frames
        if times and times[-1] != timestamp_begin:
            end = frame(times[-1])
        return [WindowSegment(seek, end, tokens)], seek + num_frames
    cuts = [*pairs, len(tokens)] if single_ending else pairs
    segments = []
    last = 0
    for cut in cuts:
        sliced = tokens[last:cut]
        segments.append(WindowSegment(frame(sliced[0]), frame(sliced[-1]), sliced))
        last = cut
    if single_ending:
        return segments, seek + num_frames
    next_seek = frame(tokens[last - 1])
    # `<|0.00|><|0.00|>` and the like would decode the same window again for ever.
    return segments, next_seek if next_seek > seek else seek + num_frames


# ---- quality and fallback ----
def compression_ratio(token_ids: Sequence[int], vocab_size: int) -> float:
    """Repetition measure of a decoded window (transformers' definition): bytes of the token
    ids (timestamps and EOS included, each in as few bytes as the vocabulary needs) over their
    zlib-compressed size. openai-whisper compresses the text instead, which rates a sentence
    really spoken twice in a window (2.5) as a loop; token bytes rate it 1.7 and a true loop
    far above the 2.4 threshold."""
    if not len(token_ids):
        return 0.0
    width = int(math.log2(vocab_size) / 8) + 1
    # Each id's `width` low bytes, little-endian (int.to_bytes(width, "little") per id, in
    # one numpy pass; with zlib, 20 -> 14 us for a 101-token window on a CI-class CPU).
    data = np.asarray(token_ids, dtype="<u8").view(np.uint8).reshape(-1, 8)[:, :width].tobytes()
    return len(data) / len(zlib.compress(data))


def average_logprob(logprobs: Sequence[float] | None) -> float:
    """Mean logprob of a window's sampled tokens, EOS included (openai-whisper); NaN without."""
    if not logprobs:
        return float("nan")
    return math.fsum(logprobs) / len(logprobs)


@dataclass(frozen=True)
class DecodeQuality:
    """What the fallback rule looks at in one decoded window."""

    compression_ratio: float
    avg_logprob: float
    no_speech_prob: float | None


class Verdict(enum.Enum):
    ACCEPT = "accept"
    RETRY = "retry"
    """Too repetitive or too unlikely: decode again at the next temperature."""
    SKIP = "skip"
    """Silence: unlikely text and a likely <|nospeech|>; the window yields no segment."""


@dataclass(frozen=True)
class TemperatureFallback:
    """Decode at `temperatures[0]`; while the result is too repetitive (compression ratio above
    `compression_ratio_threshold`) or too unlikely (mean logprob below `logprob_threshold`),
    decode again at the next temperature; the last attempt stands. An unlikely window whose
    `<|nospeech|>` probability is above `no_speech_threshold` is silence and is skipped.
    A threshold of None disables its test (skipping needs both logprob and no-speech ones)."""

    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    def __post_init__(self) -> None:
        temperatures = self.temperatures
        if isinstance(temperatures, (int, float)):
            temperatures = (float(temperatures),)
        temperatures = tuple(temperatures)
        if not temperatures:
            raise ValueError("temperature needs at least one value")
        for t in temperatures:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 2.0:
                raise ValueError(f"temperatures must be numbers in [0, 2], got {t!r}")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temperatures))
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number or None, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.no_speech_threshold is not None and not 0.0 <= self.no_speech_threshold <= 1.0:
            raise ValueError(
                f"no_speech_threshold must be in [0, 1], got {self.no_speech_threshold}"
            )

    @classmethod
    def starting_at(cls, temperature: float, **thresholds: float | None) -> TemperatureFallback:
        """The default steps of 0.2 from `temperature` up to 1.0 (just `temperature` above 1)."""
        steps = [temperature] + [t for t in DEFAULT_TEMPERATURES if t > temperature + 1e-9]
        return cls(tuple(steps), **thresholds)

    def verdict(self, quality: DecodeQuality) -> Verdict:
        """transformers' `_need_fallback`: RETRY, SKIP or ACCEPT (a NaN logprob, from a window
        decoded without logprobs, passes the logprob test)."""
        unlikely = self.logprob_threshold is not None and quality.avg_logprob < (
            self.logprob_threshold
        )
        if (
            unlikely
            and self.no_speech_threshold is not None
            and quality.no_speech_prob is not None
            and quality.no_speech_prob > self.no_speech_threshold
        ):
            return Verdict.SKIP
        repetitive = self.compression_ratio_threshold is not None and (
            quality.compression_ratio > self.compression_ratio_threshold
        )
        return Verdict.RETRY if repetitive or unlikely else Verdict.ACCEPT

    def is_last(self, attempt: int) -> bool:
        return attempt >= len(self.temperatures) - 1
