"""Sampling: per-slot state (one module per rule under states/), per-step metadata and the Sampler."""

from v1.sample.metadata import SamplingMetadata, WhisperTokenInfo
from v1.sample.sampler import Sampler, SamplerOutput
from v1.sample.state import SamplingState

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "WhisperTokenInfo",
]
