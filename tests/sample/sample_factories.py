"""Factories for the sampling tests: a SamplingState filled with requests, and its metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from v1.sample import SamplingMetadata, SamplingState, WhisperTokenInfo
from v1.sampling_params import SamplingParams

VOCAB_SIZE = 64
MAX_MODEL_LEN = 96


@dataclass
class Req:
    """One request to place in a state: params, decoder prompt and outputs so far."""

    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    outputs: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    max_output_tokens: int | None = None


def make_state(
    reqs: Sequence[Req],
    *,
    slots: Sequence[int] | None = None,
    vocab_size: int = VOCAB_SIZE,
    max_model_len: int = MAX_MODEL_LEN,
    max_num_reqs: int | None = None,
    whisper: WhisperTokenInfo | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[SamplingState, SamplingMetadata]:
    """Adds `reqs` (at `slots`, default 0..n-1) and returns the state and its step metadata."""
    slots = list(range(len(reqs))) if slots is None else list(slots)
    state = SamplingState(
        max_num_reqs=max_num_reqs or max(slots) + 1,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        device=torch.device(device),
        whisper=whisper,
        seed=seed,
    )
    for slot, req in zip(slots, reqs, strict=True):
        state.add_request(
            slot,
            req.params,
            req.prompt,
            req.outputs,
            req.eos_token_id,
            max_output_tokens=req.max_output_tokens,
        )
    return state, state.make_metadata(slots)
