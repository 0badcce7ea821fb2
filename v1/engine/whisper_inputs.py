"""Where the Whisper input builder lived: its names, re-exported from `v1.engine.inputs.whisper`
for the transcription code, plus `AsyncLLM.transcribe`'s hook (both move with the transcription
rewrite)."""

from __future__ import annotations

from typing import Any

from v1.engine.inputs.whisper import (
    TASKS,
    WINDOW_SECONDS,
    WhisperInputBuilder,
    WhisperInputError,
    normalize_language,
)
from v1.model_info import WhisperTokens
from v1.sampling_params import SamplingParams

__all__ = [
    "TASKS",
    "WINDOW_SECONDS",
    "WhisperInputBuilder",
    "WhisperInputError",
    "WhisperTokens",
    "normalize_language",
    "transcribe_async",
]


async def transcribe_async(
    llm: Any,
    audio: Any,
    sampling_params: SamplingParams | None = None,
    request_id: str | None = None,
    **options: Any,
) -> Any:
    """`AsyncLLM.transcribe`'s hook: `AsyncTranscriber(llm).transcribe(...)`."""
    from v1.engine.transcription import AsyncTranscriber

    return await AsyncTranscriber(llm).transcribe(
        audio, sampling_params=sampling_params, request_id=request_id, **options
    )
