"""Triton kernel of the per-row fp8 quantizer (optionally with GELU, bias and an
`Fp8Product`'s scales fused): one read of x, one write of its fp8 rows and float32 scales.
Must hold: results equal the torch reference `quantize_rows` (v1/quantization/fp8.py), which
launches abs, amax, a reciprocal multiply, clamp and the cast as separate passes over x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 5
"""Column chunks a program holds per row (the widths of Whisper, BART and BERT split exactly)."""


def row_chunks(n_cols: int) -> tuple[int, int]:
    """(chunk, num_chunks): the narrowest power-of-two chunk, at least 16 wide, that covers
    n_cols in at most MAX_CHUNKS.

    With GELU fused, a row is held in registers as these chunks (5120 = 5 x 1024, 1280 = 5 x
    256) rather than one block padded to the next power of two, whose masked lanes would
    compute erf too; plain rows take a single padded chunk (docs/decisions.md)."""
    chunk = max(16, triton.next_power_of_2(triton.cdiv(n_cols, MAX_CHUNKS)))
    return chunk, triton.cdiv(n_cols, chunk)


def row_layout(n_cols: int, gelu: bool) -> tuple[int, int]:
    """(chunk, num_chunks) a program holds a row in: `row_chunks` with GELU, else one chunk
    padded to the next power of two."""
    return row_chunks(n_cols) if gelu else (triton.next_power_of_2(n_cols), 1)


def launch_shape(width: int, gelu: bool) -> tuple[int, int]:
    """(rows a program, warps) for rows held as `width` register columns.

    About 4K elements a program (the fastest at 768 to 5120 columns on an H100). With GELU the
    kernel is bound by its float conversions, not HBM, and 4 warps (40 values a thread at 5120
    columns) beat 8: 346 against 421 us at 48,000 x 5120."""
    rows = 1
    while rows < 8 and 2 * rows * width <= 4096:
        rows *= 2
    warps = 4 if rows * width <= 4096 or (gelu and width <= 8192) else 8
    return rows, warps


GELU_FORMS = {None: 0, "erf": 1, "tanh": 2}
"""The kernel's GELU argument: none, the exact erf form, or the tanh form."""


@triton.jit
def _load_chunk(
    x_rows,
    row_mask,
    n_cols,
    epilogue,
    c: tl.constexpr,
    CHUNK: tl.constexpr,
    GELU: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Columns [c * CHUNK, (c + 1) * CHUNK) of the rows (`x_rows`: pointers to their starts)
    in float32 (masked columns are 0): x, or x * row_scale * col_scale (SCALED: an
    `Fp8Product`), plus the bias (HAS_BIAS) in float32 and rounded once to x's dtype, as a GEMM
    epilogue leaves it; then GELU (GELU_FORMS) rounded to x's dtype, as a separate activation
    would leave it. `epilogue` = (row scales, ColScale, Bias)."""
    cols = c * CHUNK + tl.arange(0, CHUNK)
    col_mask = cols < n_cols
    x = tl.load(x_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    if SCALED or HAS_BIAS:
        row_scale, ColScale, Bias = epilogue
        xf = x.to(tl.float32)
        if SCALED:
            col_scale = tl.load(ColScale + cols, mask=col_mask, other=0.0)
            xf = xf * row_scale[:, None] * col_scale[None, :]
        if HAS_BIAS:
            xf += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        x = xf.to(x.dtype)
    if GELU == 1:
        xf = x.to(tl.float32)
        x = (0.5 * xf * (1.0 + tl.math.erf(xf * 0.7071067811865476))).to(x.dtype)
    if GELU == 2:
        # 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), with the GPU's tanh
        # instruction (relative error ~2^-11, under the 16-bit rounding that follows; the
        # exp-and-divide form made this kernel compute-bound: 389 us at 48,000 x 5120).
        xf = x.to(tl.float32)
        u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1
        )
        x = (0.5 * xf * (1.0 + t)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _store_chunk(
    Q, rows, row_mask, stride_q, n_cols, x, inv, fp8_max, c: tl.constexpr, CHUNK: tl.constexpr
):
    cols = c * CHUNK + tl.arange(0, CHUNK)
    q = tl.minimum(tl.maximum(x * inv[:, None], -fp8_max), fp8_max)
    tl.store(
        Q + rows[:, None] * stride_q + cols[None, :],
        q.to(Q.dtype.element_ty),
        mask=row_mask[:, None] & (cols < n_cols)[None, :],
    )


@triton.jit
def _quantize_rows_kernel(
    X,
    Q,
    Scale,
    n_rows,
    n_cols,
    stride_x,
    stride_q,
    fp8_max,
    min_scale,
    RowScale,
    ColScale,
    Bias,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    GELU: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_mask = rows < n_rows
    x_rows = X + rows[:, None] * stride_x
    row_scale = tl.full([ROWS], 1.0, tl.float32)
    if SCALED:
        row_scale = tl.load(RowScale + rows, mask=row_mask, other=0.0)
    epilogue = (row_scale, ColScale, Bias)
    # One register tile per chunk (constexpr branches: the unused ones are never built).
    x0 = _load_chunk(x_rows, row_mask, n_cols, epilogue, 0, CHUNK, GELU, SCALED, HAS_BIAS)
    amax = tl.max(tl.abs(x0), axis=1)
    if NUM_CHUNKS > 1:
        x1 = _load_chunk(x_rows, row_mask, n_cols, epilogue, 1, CHUNK, GELU, SCALED, HAS_BIAS)
        amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
    if NUM_CHUNKS > 2:
        x2 = _load_chunk(x_rows, row_mask, n_cols, epilogue, 2, CHUNK, GELU, SCALED, HAS_BIAS)
        amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=1))
    if NUM_CHUNKS > 3:
        x3 = _load_chunk(x_rows, row_mask, n_cols, epilogue, 3, CHUNK, GELU, SCALED, HAS_BIAS)
        amax = tl.maximum(amax, tl.max(tl.abs(x3), axis=1))
    if NUM_CHUNKS > 4:
        x4 = _load_chunk(x_rows, row_mask, n_cols, epilogue, 4, CHUNK, GELU, SCALED, HAS_BIAS)
        amax = tl.maximum(amax, tl.max(tl.abs(x4), axis=1))
    scale = tl.maximum(amax / fp8_max, min_scale)
    # The correctly rounded reciprocal (Triton's `/` is approximate) times x: quantize_rows'
    # values exactly.
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
    _store_chunk(Q, rows, row_mask, stride_q, n_cols, x0, inv, fp8_max, 0, CHUNK)
    if NUM_CHUNKS > 1:
        _store_chunk(Q, rows, row_mask, stride_q, n_cols, x1, inv, fp8_max, 1, CHUNK)
    if NUM_CHUNKS > 2:
        _store_chunk(Q, rows, row_mask, stride_q, n_cols, x2, inv, fp8_max, 2, CHUNK)
    if NUM_CHUNKS > 3:
        _store_chunk(Q, rows, row_mask, stride_q, n_cols, x3, inv, fp8_max, 3, CHUNK)
    if NUM_CHUNKS > 4:
        _store_chunk(Q, rows, row_mask, stride_q, n_cols, x4, inv, fp8_max, 4, CHUNK)
    tl.store(Scale + rows, scale, mask=row_mask)


def quantize_rows_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    fp8_max: float,
    min_scale: float,
    gelu: str | None = None,
    bias: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided, columns contiguous) -> (q [M, K] fp8, scales [M] fp32)
    of x, or of GELU(x) in the `gelu` form ("erf" or "tanh"); x is first scaled by `scales` =
    (row scales [M], column scales [K]) (an `Fp8Product`'s) and `bias` [K] added. `launch` =
    (rows a program, warps) overrides `launch_shape` (benchmarks/quant_micro.py sweeps it)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    chunk, num_chunks = row_layout(k, gelu is not None)
    width = chunk * num_chunks
    rows, warps = launch or launch_shape(width, gelu is not None)
    _quantize_rows_kernel[(triton.cdiv(m, rows),)](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        q.stride(0),
        fp8_max,
        min_scale,
        scales[0] if scales is not None else scale,  # unused pointers when not SCALED ...
        scales[1] if scales is not None else scale,
        bias if bias is not None else scale,  # ... or not HAS_BIAS
        CHUNK=chunk,
        NUM_CHUNKS=num_chunks,
        ROWS=rows,
        GELU=GELU_FORMS[gelu],
        SCALED=scales is not None,
        HAS_BIAS=bias is not None,
        num_warps=warps,
    )
    return q, scale
