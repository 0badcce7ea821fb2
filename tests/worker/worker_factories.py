"""Shared factories of the worker tests: tiny BART / Llama folders, EngineCore requests with
multi-token decoder prompts, a drain loop, and the runner behind an in-process EngineCore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests import utils
from v1.config import make_engine_config
from v1.core.engine_core import EngineCore
from v1.core.protocol import EncoderInput, EngineCoreRequest
from v1.executor.uniproc import UniProcExecutor
from v1.sampling_params import SamplingParams

EOS = 2
"""The tiny tokenizer's </s> (BART's decoder start, too)."""


def make_tiny_bart_dir(path: Path) -> str:
    """A BART whose greedy outputs vary with the input (plain greedy in transformers)."""
    return utils.make_tiny_bart_dir(
        path, bart_tokenizer=False, base=utils.TINY_BART_WIDE, init_std=0.2
    )


def make_core(path: str, **overrides: Any) -> EngineCore:
    """An in-process EngineCore in float32 (CPU unless `device` is given)."""
    args = dict(device="cpu", dtype="float32", block_size=16, enable_prefix_caching=False)
    return EngineCore(make_engine_config(path, **{**args, **overrides}), UniProcExecutor)


def llama_prompts(n: int) -> list[list[int]]:
    """Prompts of 2 to ~40 tokens (short ones fit a graph whole, long ones are chunked)."""
    return [[1] + [(7 * i + 3 * j) % 300 + 4 for j in range(1 + (9 * i) % 40)] for i in range(n)]


def bart_inputs(n: int) -> list[tuple[list[int], list[int]]]:
    """(encoder ids, decoder prompt) pairs: decoder prompts of 1 to 6 tokens, so first steps
    carry multi-token queries."""
    out = []
    for i in range(n):
        encoder = [1] + [(11 * i + 5 * j) % 300 + 4 for j in range(4 + (6 * i) % 30)] + [EOS]
        decoder = [EOS] + [(13 * i + j) % 300 + 4 for j in range(i % 6)]
        out.append((encoder, decoder))
    return out


def max_tokens_of(i: int) -> int:
    """Different lengths, so requests finish at different steps and new ones join decodes."""
    return 5 + (7 * i) % 17


def decoder_request(
    i: int, prompt: list[int], encoder: list[int] | None = None
) -> EngineCoreRequest:
    encoder_input = None
    if encoder is not None:
        encoder_input = EncoderInput(
            num_encoder_tokens=len(encoder), content_hash=f"ids:{encoder}", token_ids=encoder
        )
    return EngineCoreRequest(
        request_id=f"r{i}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i)),
        encoder_input=encoder_input,
        eos_token_id=EOS,
    )


def drain(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Runs the requests to completion (none may fail): request id -> generated tokens."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    for _ in range(10_000):
        if not core.has_work():
            break
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    assert not core.has_work(), "the engine did not drain"
    stats = core.get_stats()
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
    return tokens


def runner_of(core: EngineCore) -> Any:
    """The ModelRunner behind an in-process EngineCore."""
    return core.executor.worker.model_runner
