"""Audio for the frontend and the runner: decoding, resampling, log-mel, long-form windows.

`load_audio` (any source -> float32 mono 16 kHz), `AudioClip` (samples + hash computed once),
`LogMelSpectrogram` on the runner's device, `chunking` for long recordings and timestamps.
Importing the package loads neither torch nor a decoder (a text-only server imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1.audio.chunking import (
    WHISPER_TIME_PRECISION,
    AudioWindow,
    Segment,
    split_windows,
    timestamp_segments,
    timestamp_to_seconds,
)
from v1.audio.clip import AudioClip
from v1.audio.decode import (
    MIN_AUDIO_SECONDS,
    SAMPLE_RATE,
    AudioError,
    AudioSource,
    load_audio,
)

if TYPE_CHECKING:
    from v1.audio.features import LogMelSpectrogram

__all__ = [
    "MIN_AUDIO_SECONDS",
    "SAMPLE_RATE",
    "WHISPER_TIME_PRECISION",
    "AudioClip",
    "AudioError",
    "AudioSource",
    "AudioWindow",
    "LogMelSpectrogram",
    "Segment",
    "load_audio",
    "split_windows",
    "timestamp_segments",
    "timestamp_to_seconds",
]


def __getattr__(name: str) -> Any:
    if name == "LogMelSpectrogram":
        from v1.audio.features import LogMelSpectrogram

        return LogMelSpectrogram
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
