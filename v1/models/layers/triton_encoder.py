"""Triton kernels of an encoder-only step's remaining elementwise work, each one launch where the
torch path takes several, and each held to that torch path as its reference:

- `embed_layer_norm_triton`: BERT's embeddings, LayerNorm(word[id] + position[pos] +
  token_type[type]) (`BertEmbeddings.forward` off the fused path: two gathers, two adds and a
  LayerNorm, five kernels and three [T, H] intermediates);
- `segment_mean_triton`: mean (or mean / sqrt(length)) pooling of packed requests, optionally
  L2-normalized (`pool_tokens` + `l2_normalize` off the fused path: a float32 copy of the
  hidden states, a zero fill, an atomic index_add, a divide and the normalize's kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embed_layer_norm_kernel(
    Ids,
    Positions,
    Types,
    Word,
    Pos,
    Type,
    Weight,
    Bias,
    Out,
    num_rows,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_TYPES: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    ids = tl.load(Ids + rows, mask=row_mask, other=0).to(tl.int64)
    pos = tl.load(Positions + rows, mask=row_mask, other=0).to(tl.int64)
    w = tl.load(Word + ids[:, None] * D + cols[None, :], mask=mask, other=0.0)
    p = tl.load(Pos + pos[:, None] * D + cols[None, :], mask=mask, other=0.0)
    # The torch path's rounding points: word + position rounded, then + type rounded.
    h = (w.to(tl.float32) + p.to(tl.float32)).to(Out.dtype.element_ty)
    if HAS_TYPES:
        types = tl.load(Types + rows, mask=row_mask, other=0).to(tl.int64)
        t = tl.load(Type + types[:, None] * D + cols[None, :], mask=mask, other=0.0)
    else:
        t = tl.load(Type + cols, mask=col_mask, other=0.0)[None, :]
    h = (h.to(tl.float32) + t.to(tl.float32)).to(Out.dtype.element_ty)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    mean = tl.sum(hf, axis=1) / D
    centered = tl.where(mask, hf - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    g = tl.load(Weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * g[None, :] + b[None, :]
    rows64 = rows.to(tl.int64)
    tl.store(Out + rows64[:, None] * D + cols[None, :], y.to(Out.dtype.element_ty), mask=mask)


def embed_layer_norm_triton(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    token_type_ids: torch.Tensor | None,
    word: torch.Tensor,
    position_table: torch.Tensor,
    type_table: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """input_ids, positions, token_type_ids [T] (integers; token_type_ids None: type 0 for
    every token) and the tables [*, D] (contiguous, one dtype) -> LayerNorm(word[id] +
    position[pos] + type[t]) * weight + bias [T, D] in the tables' dtype.

    What the kernel computes, replacing two gathers, two adds and a LayerNorm:

        h = word[id] + position[pos]   rounded to the tables' dtype (the torch path's add)
        h = h + type[t]                rounded again
        y = LayerNorm(h)               in float32 from the rounded h, then rounded
    """
    assert word.is_contiguous() and position_table.is_contiguous() and type_table.is_contiguous()
    assert word.dtype == position_table.dtype == type_table.dtype
    num_rows, d = input_ids.shape[0], word.shape[1]
    out = torch.empty((num_rows, d), dtype=word.dtype, device=word.device)
    if num_rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block_d))
    _embed_layer_norm_kernel[(triton.cdiv(num_rows, rows),)](
        input_ids,
        positions,
        token_type_ids if token_type_ids is not None else input_ids,  # unused without types
        word,
        position_table,
        type_table,
        weight,
        bias,
        out,
        num_rows,
        eps,
        D=d,
        BLOCK_D=block_d,
        ROWS=rows,
        HAS_TYPES=token_type_ids is not None,
        num_warps=4 if block_d <= 2048 else 8,
    )
    return out


@triton.jit
def _segment_mean_kernel(
    Hidden,
    Offsets,
    Out,
    stride_h,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    SQRT_LEN: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(Offsets + req).to(tl.int64)
    end = tl.load(Offsets + req + 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for first in range(start, end, ROWS):
        rows = first + tl.arange(0, ROWS)
        mask = (rows < end)[:, None] & col_mask[None, :]
        x = tl.load(Hidden + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32)
    total = tl.sum(acc, axis=0)  # [BLOCK_D]
    length = (end - start).to(tl.float32)
    if SQRT_LEN:
        pooled = total / tl.sqrt(length)
    else:
        pooled = total / length
    if NORMALIZE:
        # F.normalize: x / max(||x||, 1e-12)
        norm = tl.sqrt(tl.sum(tl.where(col_mask, pooled * pooled, 0.0), axis=0))
        pooled = pooled / tl.maximum(norm, 1e-12)
    tl.store(Out + req.to(tl.int64) * D + cols, pooled, mask=col_mask)


def segment_mean_triton(
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    sqrt_len: bool = False,
    normalize: bool = False,
) -> torch.Tensor:
    """hidden [T, D] (rows may be strided, columns contiguous) of R packed requests whose token
    offsets are query_start_loc [R + 1] (on hidden's device; every request at least one token)
    -> float32 [R, D]: each request's mean (`sqrt_len`: sum / sqrt(length)), L2-normalized when
    `normalize`. One program per request sums its rows in float32 (a fixed order, where the
    reference's atomic index_add has none: the two agree to float32 rounding)."""
    assert hidden.dim() == 2 and hidden.stride(1) == 1, (hidden.shape, hidden.stride())
    num_reqs, d = query_start_loc.shape[0] - 1, hidden.shape[1]
    out = torch.empty((num_reqs, d), dtype=torch.float32, device=hidden.device)
    if num_reqs == 0:
        return out
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 8192 // block_d))
    _segment_mean_kernel[(num_reqs,)](
        hidden,
        query_start_loc,
        out,
        hidden.stride(0),
        D=d,
        BLOCK_D=block_d,
        ROWS=rows,
        SQRT_LEN=sqrt_len,
        NORMALIZE=normalize,
        num_warps=4 if block_d <= 1024 else 8,
    )
    return out
