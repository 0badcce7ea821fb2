"""GPU end to end: the Triton backend and CUDA graphs give transformers' greedy tokens.

Marked `gpu`; skipped without CUDA. fp32 with IEEE dots so greedy ties cannot flip.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import (
    TINY_BART_WIDE,
    make_tiny_bart_dir,
    make_tiny_llama_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def hf_greedy(model, prompts, max_new_tokens, eos, **kwargs):
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        tokens = gen[0].tolist()
        tokens = tokens[len(p) :] if not model.config.is_encoder_decoder else tokens[1:]
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        outs.append(tokens)
    return outs


def run_ours(path, prompts, max_tokens, enforce_eager, **kwargs):
    from v1 import LLM, SamplingParams

    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        multiprocess=False,
        enforce_eager=enforce_eager,
        **kwargs,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            use_tqdm=False,
        )
        assert llm.llm_engine.get_stats()["num_kv_requests"] == 0
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_triton_is_the_default_gpu_backend():
    import dataclasses

    from v1.attention.backend import AttentionType
    from v1.attention.selector import AttentionNeeds, select_backend

    cc = torch.cuda.get_device_capability()
    needs = AttentionNeeds(frozenset({AttentionType.DECODER}), "cuda", cc)
    assert select_backend(needs).name == "triton"
    assert select_backend(dataclasses.replace(needs, bias=True)).name == "triton"


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_llama_matches_transformers(tmp_path, enforce_eager):
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [[1] + [(7 * i + 3 * j) % 300 + 4 for j in range(3 + 5 * i)] for i in range(10)]
    expected = hf_greedy(model, prompts, 24, model.config.eos_token_id)
    # Chunked prefill (budget 32), preemption (few blocks) and mixed batches on the GPU path.
    got = run_ours(
        path,
        prompts,
        24,
        enforce_eager,
        num_kv_blocks=24,
        block_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    assert got == expected


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_bart_matches_transformers(tmp_path, enforce_eager):
    from transformers import BartForConditionalGeneration

    path = make_tiny_bart_dir(tmp_path, bart_tokenizer=False, base=TINY_BART_WIDE, init_std=0.2)
    model = BartForConditionalGeneration.from_pretrained(path).cuda().eval()
    prompts = [[1] + [(11 * i + 5 * j) % 300 + 4 for j in range(4 + 6 * i)] + [2] for i in range(9)]
    expected = hf_greedy(model, prompts, 20, model.config.eos_token_id)
    got = run_ours(
        path, prompts, 20, enforce_eager, num_kv_blocks=40, block_size=16, max_num_seqs=5
    )
    assert got == expected


def test_two_engines_share_one_gpu(tmp_path):
    """gpu_memory_utilization is each engine's own budget (v1/worker/gpu_memory.py, as in
    vLLM): a second engine at 0.35 starts beside a first that holds 0.35 of the device and
    gets as many KV blocks (before, the first's memory came off the second's share: it could
    not start)."""
    from v1 import LLM, SamplingParams

    path = make_tiny_llama_dir(tmp_path / "llama")
    torch.cuda.empty_cache()  # what earlier tests of this process left cached
    engines = []
    try:
        for _ in range(2):
            engines.append(LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.35))
        params = SamplingParams(temperature=0, max_tokens=8)
        outs = [
            e.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False) for e in engines
        ]
        assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
        first, second = (e.llm_engine.get_stats()["num_total_blocks"] for e in engines)
        assert second >= 0.95 * first > 0
    finally:
        for engine in engines:
            engine.shutdown()
