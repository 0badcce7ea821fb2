"""Sampling: per-slot state, per-step metadata, batched logits rules and the Sampler."""

from v1.sample.metadata import (
    RowTokenIds,
    SamplingMetadata,
    WhisperTimestampMetadata,
    WhisperTokenInfo,
)
from v1.sample.sampler import Sampler, SamplerOutput
from v1.sample.state import SamplingState

__all__ = [
    "RowTokenIds",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "WhisperTimestampMetadata",
    "WhisperTokenInfo",
]
