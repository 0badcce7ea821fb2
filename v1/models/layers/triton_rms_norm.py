"""Triton kernel of the residual add fused with RMSNorm (one read of each input, one write of
each output), held to the torch reference: `RMSNorm.forward` off the fused path
(`v1.models.layers.norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    num_rows,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    h = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + rows64[:, None] * stride_ro + cols[None, :], h, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    var = tl.sum(hf * hf, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = (hf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(
        Out + rows64[:, None] * stride_o + cols[None, :],
        (w[None, :] * y).to(Out.dtype.element_ty),
        mask=mask,
    )


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, D] (rows may be strided, columns contiguous), residual [T, D] or None ->
    (RMSNorm(h), h) with h = x + residual (h is None without residual, where h = x).

    The rounding points of the torch path, so the two agree but for float32 summation order
    and rsqrt:

        h   = x + residual                      rounded to x's dtype
        y   = h * rsqrt(mean(h^2) + eps)        float32 from the rounded h, rounded to x's dtype
        out = weight * y                        float32, rounded to the promoted dtype of
                                                weight and x (x's dtype for a 16-bit model)

    One launch replaces the torch path's add, float, pow, mean, add, rsqrt, mul, to and mul."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        assert residual.dtype == x.dtype
    num_rows, d = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_rows, d), dtype=out_dtype, device=x.device)
    h = torch.empty((num_rows, d), dtype=x.dtype, device=x.device) if residual is not None else None
    if num_rows == 0:
        return out, h
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block_d))
    num_warps = 4 if block_d <= 2048 else 8
    _add_rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        residual if residual is not None else x,  # an unused pointer without residual
        weight,
        out,
        h if h is not None else out,
        num_rows,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        h.stride(0) if h is not None else 0,
        eps,
        D=d,
        BLOCK_D=block_d,
        ROWS=rows,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
    )
    return out, h
