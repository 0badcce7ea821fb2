"""The three capacity hangs of issue 14 through the public API: each is now a clear error naming
the knob, within seconds, instead of a `generate` that never returns."""

from __future__ import annotations

import time

import pytest

from tests.utils import ASSETS, needs_assets
from v1 import LLM, SamplingParams


def test_kv_cache_smaller_than_one_request_is_refused_at_start(tiny_llama_dir: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"num_kv_blocks=8.*max_model_len <= 28"):
        LLM(tiny_llama_dir, multiprocess=False, device="cpu", num_kv_blocks=8, block_size=4)
    assert time.monotonic() - start < 30


def test_the_refusal_crosses_the_process_boundary(tiny_llama_dir: str) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="num_kv_blocks=8"):
        LLM(tiny_llama_dir, multiprocess=True, device="cpu", num_kv_blocks=8, block_size=4)
    assert time.monotonic() - start < 60


def test_unchunked_budget_below_max_model_len_is_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        LLM(
            tiny_llama_dir,
            multiprocess=False,
            device="cpu",
            enable_chunked_prefill=False,
            max_num_batched_tokens=16,
        )
    # Within the budget the same settings serve a 12-token prompt.
    with LLM(
        tiny_llama_dir,
        multiprocess=False,
        device="cpu",
        enable_chunked_prefill=False,
        max_num_batched_tokens=16,
        max_model_len=16,
    ) as llm:
        out = llm.generate(
            {"prompt_token_ids": list(range(5, 17))},
            SamplingParams(max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
    assert len(out[0].outputs[0].token_ids) == 2


@needs_assets(ASSETS / "whisper-base")
def test_whisper_cache_without_room_for_cross_blocks_is_refused() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="not even the cross-attention blocks"):
        LLM(str(ASSETS / "whisper-base"), multiprocess=False, device="cpu", num_kv_blocks=64)
    assert time.monotonic() - start < 60
