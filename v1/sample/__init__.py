"""Sampling: per-slot state (one module per rule under states/), per-step metadata and the Sampler."""

from v1.sample.metadata import SamplingMetadata
from v1.sample.sampler import Sampler, SamplerOutput
from v1.sample.state import SamplingState
from v1.sample.states.whisper_timestamps import WhisperTokenInfo

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "WhisperTokenInfo",
]
