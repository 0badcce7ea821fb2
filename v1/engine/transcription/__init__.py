"""Whisper transcription over the engine: audio -> seek-based 30 s windows -> timed segments.

One plan per waveform (`plan.py`, checked `options.py`, segments assembled by `segments.py`,
with the model-free rules of `seek.py` and `words.py`) runs
under either driver: `Transcriber` (offline `LLM`) or `AsyncTranscriber` (`AsyncLLM`, the
server); `merging.py` runs long uploads chunk by chunk. The names below are the package's API.
"""

from v1.engine.transcription.loading import load_audio_inputs
from v1.engine.transcription.merging import ChunkMerger, chunk_events
from v1.engine.transcription.offline import Transcriber, TranscriptionStream
from v1.engine.transcription.options import TranscriptionOptions
from v1.engine.transcription.plan import TranscriptionPlanner
from v1.engine.transcription.segments import (
    TranscriptionError,
    TranscriptionResult,
    TranscriptionSegment,
)
from v1.engine.transcription.streaming import (
    AsyncTranscriber,
    InputDone,
    TranscriptionEvent,
    WindowText,
)

__all__ = [
    "AsyncTranscriber",
    "ChunkMerger",
    "InputDone",
    "TranscriptionError",
    "TranscriptionEvent",
    "TranscriptionOptions",
    "TranscriptionPlanner",
    "TranscriptionResult",
    "TranscriptionSegment",
    "TranscriptionStream",
    "Transcriber",
    "WindowText",
    "chunk_events",
    "load_audio_inputs",
]
