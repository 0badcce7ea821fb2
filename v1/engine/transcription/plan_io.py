"""What a transcription plan and its driver exchange: the window requests a plan yields, the
outputs it takes back, and a file's progress for progress bars (`plan.py` makes the plans;
`offline.py`, `streaming.py` and `windows.py` drive them)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from v1.core.protocol import EngineCoreRequest
from v1.engine.beam_search import BeamSearchParams
from v1.engine.transcription.segments import TranscriptionResult, TranscriptionSegment
from v1.sampling_params import SamplingParams


@dataclass(frozen=True)
class WindowRequest:
    """One window request a plan asks a driver to run, built and checked: the driver hands
    `core_requests` to the engine as they are (`add_processed_request`)."""

    request_id: str
    prompt: dict[str, Any]
    """`{"prompt_token_ids": decoder prompt, "multi_modal_data": {"audio": AudioClip}}`: what
    the request was built from."""
    params: SamplingParams
    core_requests: list[EngineCoreRequest]
    """One per sample (best_of: n children of `request_id`); a beam search's base request."""
    beam: BeamSearchParams | None = None
    """Run as a beam search (temperature 0 with beam_size): the best beam is the output."""
    length_penalty: float | None = None
    """Ranks the n > 1 samples of a best_of request (openai-whisper's ranker)."""


@dataclass(frozen=True)
class WindowOutput:
    """What a plan needs back from one finished request."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Raw logprob of each sampled token (requests ask for logprobs=0)."""
    no_speech_prob: float | None
    token_times: list[float] | None = None
    """Boundary times of the generated text tokens, seconds from the window start (requests
    with word_timestamps): text token k spans [token_times[k], token_times[k + 1]]."""


Plan = Generator[WindowRequest, WindowOutput, TranscriptionResult]
"""One waveform's windows, one request at a time (each depends on the one before)."""


@dataclass
class FileProgress:
    """How far one file's plan got, for progress bars."""

    duration: float
    """Seconds of audio."""
    done: float = 0.0
    """Seconds before the current window (all of them once the plan returns)."""
    on_segment: Callable[[TranscriptionSegment], None] | None = None
    """Called with each segment as soon as its window is decoded (final: the plan's result
    has the same segment objects, in the same order)."""
