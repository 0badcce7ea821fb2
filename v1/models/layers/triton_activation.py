"""Triton kernel of SiLU-and-mul, [T, 2I] = [gate | up] -> silu(gate) * up [T, I] in one
launch, held to the torch reference: `SiluAndMul.forward` off the fused path
(`v1.models.layers.activation`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds its result to the input dtype before the multiply.
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (rows may be strided, columns contiguous) -> silu(gate) * up [T, I] in x's
    dtype: silu computed in float32 and rounded to x's dtype, then the product in float32
    rounded, the two rounding points of `F.silu(gate) * up`."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, (x.shape, x.stride())
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 2
    )
    return out
