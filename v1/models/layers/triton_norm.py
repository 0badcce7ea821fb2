"""Triton kernel of the residual add fused with LayerNorm (optionally clamping h, taking an
fp8 Linear's unscaled product, and quantizing y per row for the next fp8 Linear).
Must hold: one read of each input and one write of each output, with results equal to the
torch reference, the unfused path of `v1.models.layers.norm.add_layer_norm`.

What the kernel computes, replacing an add kernel (two reads, one write) and a LayerNorm kernel
(one read, one write):

    h = x + residual               rounded to x's dtype, as the unfused add leaves it, then
                                   clamped to +-clamp when asked (fp16 encoder layers)
    y = LayerNorm(h) * weight + b  computed in float32 from the rounded h

An `Fp8Product` x (its out, row and column scales) is x = out * row_scale * col_scale, rounded to
out's dtype first, as the GEMM's epilogue would. `residual_bias` is the bias of the Linear whose
unscaled product the next add will bring: the stored h is h + residual_bias, rounded once, while
y normalizes h itself. With `fp8`, y is quantized as `quantize_rows` of y rounded to x's dtype:
one write of 8-bit rows and their scales instead of a 16-bit write, a quantizer read and its
write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_layer_norm_kernel(
    X,
    Residual,
    Weight,
    NormBias,
    Out,
    ResidualOut,
    Scale,
    RowScale,
    ColScale,
    ResidualBias,
    num_rows,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    clamp,
    fp8_max,
    min_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
    SCALED: tl.constexpr,
    RESIDUAL_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if SCALED:
        row_scale = tl.load(RowScale + rows64, mask=row_mask, other=0.0)
        col_scale = tl.load(ColScale + cols, mask=col_mask, other=0.0)
        x = (x.to(tl.float32) * row_scale[:, None] * col_scale[None, :]).to(X.dtype.element_ty)
    r = tl.load(Residual + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    if CLAMP:
        h = tl.minimum(tl.maximum(h.to(tl.float32), -clamp), clamp).to(X.dtype.element_ty)
    if STORE_RESIDUAL:
        stored = h
        if RESIDUAL_BIAS:
            b = tl.load(ResidualBias + cols, mask=col_mask, other=0.0).to(tl.float32)
            stored = (h.to(tl.float32) + b[None, :]).to(X.dtype.element_ty)
        tl.store(ResidualOut + rows64[:, None] * stride_ro + cols[None, :], stored, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    mean = tl.sum(hf, axis=1) / D
    centered = tl.where(mask, hf - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(Weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :]
    if HAS_NORM_BIAS:
        y += tl.load(NormBias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if FP8:
        # quantize_rows of y in x's dtype: the reciprocal of the scale correctly rounded.
        y = y.to(X.dtype.element_ty).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1) / fp8_max, min_scale)
        inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        y = tl.minimum(tl.maximum(y * inv[:, None], -fp8_max), fp8_max)
        tl.store(Scale + rows64, scale, mask=row_mask)
    tl.store(
        Out + rows64[:, None] * stride_o + cols[None, :], y.to(Out.dtype.element_ty), mask=mask
    )


def add_layer_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    eps: float,
    store_residual: bool = True,
    clamp: float | None = None,
    fp8: tuple[torch.dtype, float, float] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    residual_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """x, residual [T, D] (same dtype; rows may be strided, columns contiguous) ->
    (LayerNorm(h), h) with h = x + residual (clamped to +-clamp); h is None unless
    `store_residual`. With `fp8` = (fp8 dtype, its max, the smallest scale), LayerNorm(h)
    comes quantized per row: (q [T, D], float32 scales [T]). `scales` = (row scales [T],
    column scales [D]) multiply x first (an `Fp8Product`); the stored h gets `residual_bias`
    [D] added (the module docstring says what each is)."""
    assert x.shape == residual.shape and x.dim() == 2, (x.shape, residual.shape)
    assert x.stride(1) == 1 and residual.stride(1) == 1
    num_rows, d = x.shape
    out = torch.empty((num_rows, d), dtype=fp8[0] if fp8 else x.dtype, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device) if fp8 else None
    residual_out = (
        torch.empty((num_rows, d), dtype=x.dtype, device=x.device) if store_residual else None
    )
    normed = (out, scale) if scale is not None else out
    if num_rows == 0:
        return normed, residual_out
    block_d = triton.next_power_of_2(d)
    # About 4K elements per program: several rows for narrow models; 4 warps up to 2048
    # columns (H100, 48,000 x 1280 with fp8 out, scaled x and residual bias: 156 us against
    # 176 with 8 warps).
    rows = max(1, min(16, 4096 // block_d))
    num_warps = 4 if block_d <= 2048 else 8
    grid = (triton.cdiv(num_rows, rows),)
    _add_layer_norm_kernel[grid](
        x,
        residual,
        weight,
        norm_bias if norm_bias is not None else weight,
        out,
        residual_out if residual_out is not None else out,
        scale if scale is not None else weight,  # an unused pointer without fp8
        scales[0] if scales is not None else weight,  # ... without scales
        scales[1] if scales is not None else weight,
        residual_bias if residual_bias is not None else weight,  # ... without residual_bias
        num_rows,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        eps,
        clamp if clamp is not None else 0.0,
        fp8[1] if fp8 else 0.0,
        fp8[2] if fp8 else 0.0,
        D=d,
        BLOCK_D=block_d,
        ROWS=rows,
        CLAMP=clamp is not None,
        HAS_NORM_BIAS=norm_bias is not None,
        STORE_RESIDUAL=store_residual,
        FP8=fp8 is not None,
        SCALED=scales is not None,
        RESIDUAL_BIAS=residual_bias is not None and store_residual,
        num_warps=num_warps,
    )
    return normed, residual_out
