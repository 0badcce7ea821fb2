"""An adapter the worker cannot read (its folder truncated or deleted after the frontend checked
it) fails only the requests that use it, with an error naming the adapter; the base model and
the other adapters in the same batch keep their outputs, no KV block stays in use, and the
engine keeps serving (the fixed folder under a new id runs again)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from v1 import LLM, LoRARequest, SamplingParams
from v1.entrypoints.llm import RequestFailedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17, 2, 8], [1, 40, 41, 42]]


def _copies(adapters: list[str], root: Path) -> list[str]:
    """Four adapter folders (copies: the test breaks two of them)."""
    paths = []
    for i, name in enumerate("abcd"):
        paths.append(str(shutil.copytree(adapters[i % 2], root / name)))
    return paths


def _truncate(folder: str) -> None:
    weights = Path(folder) / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "pipelined"])
def test_unreadable_adapter_fails_its_requests_alone(
    llama_dir: str, llama_adapters: list[str], tmp_path: Path, async_scheduling: bool
) -> None:
    paths = _copies(llama_adapters, tmp_path)
    a, _, _, d = paths
    la, lb, lc, ld = (
        LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(zip("abcd", paths, strict=True))
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(
        llama_dir,
        multiprocess=False,
        num_kv_blocks=128,
        block_size=4,
        max_model_len=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        async_scheduling=async_scheduling,
    ) as llm:
        # Warm-up: the frontend checks all four, the worker reads all four; b and c last, so
        # a and d leave the worker's two device slots and its host cache of two.
        first = llm.generate(prompts * 2, GREEDY, lora_request=[la, ld, la, ld])
        want_a = first[0].outputs[0].token_ids
        want = llm.generate(prompts * 2, GREEDY, lora_request=[None, lb, lc, None])
        want_tokens = [o.outputs[0].token_ids for o in want]
        _truncate(a)
        shutil.rmtree(d)

        lorq = [la, None, lb, ld, lc, la, None]
        batch = [prompts[0], prompts[0], prompts[1], prompts[1], prompts[0], prompts[1], prompts[1]]
        with pytest.raises(RequestFailedError) as info:
            llm.generate(batch, GREEDY, lora_request=lorq)
        outs = info.value.outputs
        for i in (0, 3, 5):  # a, d, a: each error names its adapter and what is wrong
            assert outs[i].outputs[0].finish_reason == "error"
            assert outs[i].outputs[0].token_ids == []
        assert "LoRA adapter 'a' (lora_int_id 1)" in outs[0].error
        assert "malformed adapter_model.safetensors" in outs[0].error
        assert "LoRA adapter 'd' (lora_int_id 4)" in outs[3].error
        assert "does not exist" in outs[3].error
        assert "LoRA adapter 'a'" in outs[5].error
        ok = {1: want_tokens[0], 2: want_tokens[1], 4: want_tokens[2], 6: want_tokens[3]}
        for i, tokens in ok.items():
            assert outs[i].error is None and outs[i].outputs[0].token_ids == tokens, i

        stats = llm.llm_engine.get_stats()
        assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0
        assert stats["num_used_blocks"] == 0

        # The id stays failed (its rows ran into caches keyed by it); the fixed folder under
        # a new id serves again, with the adapter's own outputs.
        with pytest.raises(RequestFailedError, match="under a new lora_int_id"):
            llm.generate(prompts[0], GREEDY, lora_request=la)
        shutil.rmtree(a)
        shutil.copytree(llama_adapters[0], a)
        (again,) = llm.generate(prompts[0], GREEDY, lora_request=LoRARequest("a2", 5, a))
        assert again.outputs[0].token_ids == want_a
        (base,) = llm.generate(prompts[0], GREEDY)
        assert base.outputs[0].token_ids == want_tokens[0]
        assert llm.llm_engine.get_stats()["num_used_blocks"] == 0
