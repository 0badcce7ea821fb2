"""Audio for the frontend and the runner: decoding, resampling, log-mel, long-form windows.

The frontend calls `load_audio` (any source -> float32 mono 16 kHz) and wraps each encoder
input's samples in an `AudioClip` (content hash computed once); the model runner computes
`LogMelSpectrogram` on its device; `chunking` splits long recordings and maps timestamps.
"""

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
