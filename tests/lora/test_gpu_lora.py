"""GPU: the Triton BGMV kernels against the plain-torch oracle over named model shapes, ranks
(powers of two and not, fused sub-projections), dtypes and index mixes (-1: the base model);
and LoRA with CUDA graphs kept: a mixed batch of adapters and the base gives the same tokens
with graphs as eager, and the decode steps replay graphs. Marked `gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from v1.lora.ops import lora_delta_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {
    # name: (tokens, in, out, stacked rank = sub-projections x max_lora_rank)
    "decode_one_token": (1, 64, 96, 16),
    "turbo_qkv_decode": (256, 1280, 3840, 3 * 16),
    "turbo_fc1_encoder": (4 * 1500, 1280, 5120, 16),
    "turbo_fc2_encoder": (1500 + 7, 5120, 1280, 16),
    "llama_gate_up_rank12": (77, 512, 2 * 1376, 2 * 12),
    "odd_everything_rank5": (33, 200, 300, 5),
    "rank1": (9, 128, 128, 1),
}
INDEX_MIXES = ["mixed", "all_base", "one_adapter"]


def _case(num_tokens: int, k: int, n: int, r: int, mix: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_tokens * 7 + k + r)
    num_slots = 4
    x = torch.randn(num_tokens, k, generator=gen)
    a = torch.randn(num_slots, r, k, generator=gen) * k**-0.5
    b = torch.randn(num_slots, n, r, generator=gen) * 0.1
    if mix == "mixed":
        idx = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    elif mix == "all_base":
        idx = torch.full((num_tokens,), -1)
    else:
        idx = torch.full((num_tokens,), num_slots - 1)
    base = torch.randn(num_tokens, n, generator=gen)
    return [t.cuda() for t in (x.to(dtype), a.to(dtype), b.to(dtype), idx, base.to(dtype))]


@pytest.mark.parametrize("mix", INDEX_MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SHAPES))
def test_bgmv_kernel_equals_the_reference(name: str, dtype: torch.dtype, mix: str) -> None:
    from v1.lora.triton_ops import HAS_TRITON, bgmv_add_lora

    assert HAS_TRITON, "the GPU image has Triton"
    x, a, b, idx, base = _case(*SHAPES[name], mix, dtype)
    want = base.float() + lora_delta_reference(x, a, b, idx)
    got = bgmv_add_lora(base.clone(), x, a, b, idx)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    untouched = idx < 0
    assert torch.equal(got[untouched], base[untouched])  # base rows are not rewritten


def test_bgmv_reads_a_longer_index_buffer_and_a_strided_x() -> None:
    """The runner's index buffer is longer than the rows (padding: -1), and x may be a view."""
    from v1.lora.triton_ops import bgmv_add_lora

    x, a, b, idx, base = _case(17, 256, 384, 16, "mixed", torch.bfloat16)
    wide = torch.randn(17, 512, device="cuda", dtype=torch.bfloat16)
    wide[:, ::2] = x
    x_view = wide[:, ::2]
    padded_idx = torch.cat([idx, torch.full((15,), -1, device="cuda")])
    want = base.float() + lora_delta_reference(x, a, b, idx)
    got = bgmv_add_lora(base.clone(), x_view, a, b, padded_idx)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_cuda_graphs_with_lora_equal_eager(tmp_path) -> None:
    """Tiny Llama, a batch mixing two adapters and the base: greedy tokens with CUDA graphs
    (decode steps replay; the kernels read the index buffer in place) equal eager ones."""
    from transformers import LlamaForCausalLM

    from tests.lora.conftest import LLAMA_TARGETS, make_adapter
    from tests.utils import make_tiny_llama_dir
    from v1 import LLM, LoRARequest, SamplingParams

    path = make_tiny_llama_dir(tmp_path / "llama", initializer_range=0.2)
    adapters = [
        make_adapter(
            LlamaForCausalLM.from_pretrained(path), tmp_path / "a4", LLAMA_TARGETS, 4, seed=1
        ),
        make_adapter(
            LlamaForCausalLM.from_pretrained(path), tmp_path / "b8", ["q_proj", "v_proj"], 8, seed=2
        ),
    ]
    loras = [LoRARequest("a4", 1, adapters[0]), LoRARequest("b8", 2, adapters[1]), None]
    prompts = [{"prompt_token_ids": [1, 5, 9, 13 + i // 3]} for i in range(9)]
    per_prompt = [loras[i % 3] for i in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (True, False):
        with LLM(
            path,
            multiprocess=False,
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            num_kv_blocks=256,
            block_size=16,
            max_model_len=64,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
        ) as llm:
            outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
            runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
            if not eager:
                assert runner.cuda_graphs is not None, "LoRA must keep CUDA graphs"
                assert runner.cuda_graphs.num_replays > 0
        results[eager] = [o.outputs[0].token_ids for o in outs]
    assert results[False] == results[True]
    assert results[True][0] != results[True][2]  # adapter a4 vs the base, same prompt
