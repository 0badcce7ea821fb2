"""The batched LoRA product against its plain-torch oracle: the CPU grouped path, the masked
(graph-safe) path and, on CUDA, the Triton BGMV kernels; fused layers' block-diagonal B."""

from __future__ import annotations

import pytest
import torch

from v1.lora.ops import add_lora_grouped, add_lora_masked, lora_delta_reference

SHAPES = [(1, 32, 48, 8), (7, 64, 96, 16), (33, 1280, 3840, 48)]
"""(tokens, in, out, rank): decode, a small mixed batch, a Whisper-turbo-sized fused QKV."""


def _case(num_tokens: int, k: int, n: int, r: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_tokens + k)
    x = torch.randn(num_tokens, k, generator=gen).to(device, dtype)
    a = (torch.randn(3, r, k, generator=gen) * 0.1).to(device, dtype)
    b = (torch.randn(3, n, r, generator=gen) * 0.1).to(device, dtype)
    idx = torch.randint(-1, 3, (num_tokens,), generator=gen).to(device)
    base = torch.randn(num_tokens, n, generator=gen).to(device, dtype)
    return x, a, b, idx, base


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("path", [add_lora_grouped, add_lora_masked])
def test_cpu_paths_equal_the_reference(shape: tuple, path) -> None:
    x, a, b, idx, base = _case(*shape, "cpu", torch.float32)
    want = base + lora_delta_reference(x, a, b, idx)
    got = path(base.clone(), x, a, b, idx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    untouched = idx < 0
    assert torch.equal(got[untouched], base[untouched])  # base-model tokens get nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_bgmv_equals_the_reference(shape: tuple, dtype: torch.dtype) -> None:
    from v1.lora.triton_ops import bgmv_add_lora

    x, a, b, idx, base = _case(*shape, "cuda", dtype)
    want = base.float() + lora_delta_reference(x, a, b, idx)
    got = bgmv_add_lora(base.clone(), x, a, b, idx)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_fused_layer_slot_is_block_diagonal() -> None:
    """A QKV slot: q and v adapted (ranks 2 and 3 under max rank 4), k not: the fused product
    equals the per-projection products side by side, zeros for k."""
    import numpy as np

    from v1.lora.layers import LoRAIndices, LoRALinear
    from v1.lora.targets import LoRATarget

    target = LoRATarget("qkv", 8, (6, 4, 4), encoder_side=False)
    indices = LoRAIndices(4, 4, torch.device("cpu"))
    layer = LoRALinear(target, 2, 4, indices, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    aq, bq = torch.randn(2, 8, generator=gen), torch.randn(6, 2, generator=gen)
    av, bv = torch.randn(3, 8, generator=gen), torch.randn(4, 3, generator=gen)
    layer.set_slot(1, {0: (aq, bq), 2: (av, bv)})
    indices.set(False, np.array([1, -1, 1]))
    x = torch.randn(3, 8, generator=gen)
    out = layer.apply(x, torch.zeros(3, 14))
    want = torch.cat([x @ aq.t() @ bq.t(), torch.zeros(3, 4), x @ av.t() @ bv.t()], dim=1)
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]])
    assert torch.equal(out[1], torch.zeros(14))
