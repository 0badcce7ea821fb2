"""Triton kernels: paged varlen attention for all four attention types, and the KV write.
One kernel serves every type (packed queries [T, H, D], keys paged or packed; see
`_attention_kernel`). Must hold: results equal the torch references in `ops/reference.py`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from v1.host_copy import to_device

BIAS_NONE, BIAS_MATERIALIZED, BIAS_RELATIVE = 0, 1, 2


@triton.jit
def _relative_bucket(
    rel,
    REL_NB: tl.constexpr,
    REL_MAX_EXACT: tl.constexpr,
    REL_LOG_RATIO: tl.constexpr,
    BIDIRECTIONAL: tl.constexpr,
):
    # Same arithmetic as transformers' T5Attention._relative_position_bucket (REL_NB is
    # num_buckets, halved when bidirectional).
    if BIDIRECTIONAL:
        bucket = tl.where(rel > 0, REL_NB, 0)
        n = tl.abs(rel)
    else:
        bucket = tl.zeros_like(rel)
        n = tl.maximum(-rel, 0)
    large = REL_MAX_EXACT + (
        tl.log(tl.maximum(n, 1).to(tl.float32) / REL_MAX_EXACT)
        / REL_LOG_RATIO
        * (REL_NB - REL_MAX_EXACT)
    ).to(tl.int32)
    large = tl.minimum(large, REL_NB - 1)
    return bucket + tl.where(n < REL_MAX_EXACT, n, large)


@triton.jit
def _kv_tile(
    K, V, KScale, VScale, block_table, req, q_start, offs_n, n_mask, kv_head, offs_d, d_mask,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_scale_s, stride_bt, q,
    PAGED: tl.constexpr, PAGE: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    """Keys and values at positions `offs_n` of one request: from the paged cache through its
    block table, or the packed rows from `q_start`; fp8 rows dequantized to q's dtype."""
    if PAGED:
        block_ids = tl.load(block_table + req * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        rows = block_ids.to(tl.int64) * PAGE + offs_n % PAGE
    else:
        rows = (q_start + offs_n).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        K + rows[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + rows[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if FP8_KV:
        k_scale = tl.load(KScale + rows * stride_scale_s + kv_head, mask=n_mask, other=0.0)
        v_scale = tl.load(VScale + rows * stride_scale_s + kv_head, mask=n_mask, other=0.0)
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    return k, v


@triton.jit
def _add_bias(
    s, Bias, req, head, offs_m, offs_n, m_mask, n_mask, bias_pos, bias_stride_r, bias_stride_h,
    bias_stride_q, NUM_HEADS: tl.constexpr, BIAS_MODE: tl.constexpr, REL_NB: tl.constexpr,
    REL_MAX_EXACT: tl.constexpr, REL_LOG_RATIO: tl.constexpr, BIDIRECTIONAL: tl.constexpr,
):  # fmt: skip
    """Scores plus the bias (BIAS_MODE 1: a materialized padded tensor; 2: T5 buckets)."""
    if BIAS_MODE == 1:
        b_ptr = Bias + req * bias_stride_r + head * bias_stride_h
        s += tl.load(
            b_ptr + offs_m[:, None] * bias_stride_q + offs_n[None, :],
            mask=m_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
    if BIAS_MODE == 2:
        bucket = _relative_bucket(
            offs_n[None, :] - bias_pos[:, None],
            REL_NB,
            REL_MAX_EXACT,
            REL_LOG_RATIO,
            BIDIRECTIONAL,
        )
        s += tl.load(Bias + bucket * NUM_HEADS + head).to(tl.float32)
    return s


@triton.jit
def _online_softmax(s, valid, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key block into the running max (m_i), sum (l_i) and output (acc); a row with no
    valid key yet keeps m_i at -inf and adds nothing."""
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Queries are packed [T, H, D]; keys come either from the paged cache through the block table
# (DECODER, ENCODER_DECODER) or from packed K/V that share the query offsets (ENCODER,
# ENCODER_ONLY). Optional bias: a materialized padded tensor, or T5 relative-position buckets
# evaluated in the kernel. fp8 caches (float8_e4m3fn rows with one float32 scale per token and
# head) are quantized by the write kernel and dequantized as K/V tiles load.
@triton.jit
def _attention_kernel(
    Q, K, V, Out, query_start_loc, seq_lens, block_table, work_req, work_mblock,
    query_positions, Bias, bias_stride_r, bias_stride_h, bias_stride_q, KScale, VScale,
    stride_scale_s, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, CAUSAL: tl.constexpr, BIAS_MODE: tl.constexpr, REL_NB: tl.constexpr,
    REL_MAX_EXACT: tl.constexpr, REL_LOG_RATIO: tl.constexpr, BIDIRECTIONAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(work_req + pid)
    mblock = tl.load(work_mblock + pid)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    kv_len = tl.load(seq_lens + req)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)

    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Query j sits at position kv_len - q_len + j (chunked prefill and decode alike).
    q_pos = kv_len - q_len + offs_m
    bias_pos = offs_m  # read by relative-position bias alone
    if BIAS_MODE == 2:
        # Relative positions use the query's own sequence position (for cross-attention that
        # is the decoder position, not an offset into the encoder keys).
        bias_pos = tl.load(query_positions + q_start + offs_m, mask=m_mask, other=0).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = kv_len
    if CAUSAL:
        kv_end = tl.minimum(kv_len, kv_len - q_len + (mblock + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _kv_tile(
            K, V, KScale, VScale, block_table, req, q_start, offs_n, n_mask, kv_head, offs_d,
            d_mask, stride_ks, stride_kh, stride_vs, stride_vh, stride_scale_s, stride_bt, q,
            PAGED, PAGE, FP8_KV,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        s = _add_bias(
            s, Bias, req, head, offs_m, offs_n, m_mask, n_mask, bias_pos, bias_stride_r,
            bias_stride_h, bias_stride_q, NUM_HEADS, BIAS_MODE, REL_NB, REL_MAX_EXACT,
            REL_LOG_RATIO, BIDIRECTIONAL,
        )  # fmt: skip
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_softmax(s, valid, v, m_i, l_i, acc, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _write_kv_kernel(
    Key,
    Value,
    Cache,
    slot_mapping,
    stride_kt,
    stride_vt,
    stride_ct,
    cache_half,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping + row).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(Key + row * stride_kt + offs, mask=mask)
        v = tl.load(Value + row * stride_vt + offs, mask=mask)
        tl.store(Cache + slot * stride_ct + offs, k.to(Cache.dtype.element_ty), mask=mask)
        tl.store(
            Cache + cache_half + slot * stride_ct + offs, v.to(Cache.dtype.element_ty), mask=mask
        )


@triton.jit
def _quantize_store(
    X,
    Cache,
    Scales,
    slot,
    offs_h,
    offs_d,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One token's [H, D] row: a float32 scale per head (amax / FP8_MAX), values in fp8."""
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    idx = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x = tl.load(X + idx, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX, 1e-12)
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)
    q = q.to(Cache.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(Cache + slot * (NUM_HEADS * HEAD_DIM) + idx, q, mask=mask)
    tl.store(Scales + slot * NUM_HEADS + offs_h, scale, mask=h_mask)


@triton.jit
def _write_kv_fp8_kernel(
    Key,
    Value,
    Cache,
    Scales,
    slot_mapping,
    stride_kt,
    stride_vt,
    cache_half,
    scale_half,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping + row).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        _quantize_store(
            Key + row * stride_kt, Cache, Scales, slot, offs_h, offs_d, NUM_HEADS, HEAD_DIM, FP8_MAX
        )
        _quantize_store(
            Value + row * stride_vt,
            Cache + cache_half,
            Scales + scale_half,
            slot,
            offs_h,
            offs_d,
            NUM_HEADS,
            HEAD_DIM,
            FP8_MAX,
        )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """key/value [N, Hkv, D] -> kv_cache [2, num_blocks, block_size, Hkv, D] at flat slots
    (fp8 caches: quantized per token and head, scales to kv_scales [2, num_blocks, block_size,
    Hkv])."""
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    row = key.shape[1] * key.shape[2]
    # Rows may be strided views of a fused QKV projection; each head's values are contiguous.
    key = key.reshape(key.shape[0], row)
    value = value.reshape(value.shape[0], row)
    assert key.stride(1) == 1 and value.stride(1) == 1
    if kv_scales is not None:
        num_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        assert kv_cache[0].is_contiguous() and kv_scales[0].is_contiguous()
        _write_kv_fp8_kernel[(num_rows,)](
            key,
            value,
            kv_cache,
            kv_scales,
            slot_mapping,
            key.stride(0),
            value.stride(0),
            kv_cache.stride(0),
            kv_scales.stride(0),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            FP8_MAX=float(torch.finfo(kv_cache.dtype).max),
        )
        return
    _write_kv_kernel[(num_rows,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        row,
        kv_cache[0].numel(),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def make_work_items(
    query_start_loc_cpu: torch.Tensor, block_m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, query block) of every program, from host offsets (no device sync)."""
    offsets = query_start_loc_cpu.numpy().astype(np.int64)
    blocks = (np.diff(offsets) + block_m - 1) // block_m
    req = np.repeat(np.arange(len(blocks), dtype=np.int32), blocks)
    starts = np.cumsum(blocks) - blocks
    mblock = (np.arange(len(req)) - np.repeat(starts, blocks)).astype(np.int32)
    # One host-to-device copy for both.
    both = to_device(np.concatenate([req, mblock]), device)
    return both[: len(req)], both[len(req) :]


def _bias_args(
    q: torch.Tensor,
    bias: torch.Tensor | None,
    bias_mode: int,
    relative: tuple[int, int, bool],
) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
    """The kernel's bias pointer (q when unused), its materialized strides, and the T5
    relative-position constants (REL_NB, REL_MAX_EXACT, REL_LOG_RATIO, BIDIRECTIONAL)."""
    if bias is None:
        bias, strides = q, (0, 0, 0)
    elif bias_mode == BIAS_MATERIALIZED:
        strides = (bias.stride(0), bias.stride(1), bias.stride(2))
    else:
        bias, strides = bias.contiguous(), (0, 0, 0)
    num_buckets, max_distance, bidirectional = relative
    rel_nb = num_buckets // 2 if bidirectional else num_buckets
    rel_max_exact = rel_nb // 2
    rel = dict(
        REL_NB=rel_nb,
        REL_MAX_EXACT=rel_max_exact,
        REL_LOG_RATIO=math.log(max_distance / rel_max_exact),
        BIDIRECTIONAL=bidirectional,
    )
    return bias, strides, rel


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    work: tuple[torch.Tensor, torch.Tensor],
    query_positions: torch.Tensor | None = None,
    scale: float,
    causal: bool,
    block_table: torch.Tensor | None = None,
    page_size: int = 1,
    bias: torch.Tensor | None = None,
    bias_mode: int = BIAS_NONE,
    relative: tuple[int, int, bool] = (32, 128, True),
    block_m: int = 64,
    block_n: int = 64,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: tuple[int, int] = (4, 2),
) -> torch.Tensor:
    """q [T, H, D]; k/v either the cache halves [num_blocks * page, Hkv, D] (block_table given)
    or packed [T, Hkv, D] sharing the query offsets. Writes and returns out [T, H, D].
    kv_scales: the fp8 cache's K and V scales [num_blocks * page, Hkv] (rows like k/v).
    launch: (warps, pipeline stages) of a program (benchmarks/decode_attention.py sweeps it)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    work_req, work_mblock = work
    if work_req.numel() == 0:
        return out
    paged = block_table is not None
    if bias_mode == BIAS_RELATIVE and query_positions is None:
        raise ValueError("relative-position bias needs query_positions")
    bias, bstrides, rel = _bias_args(q, bias, bias_mode, relative)
    bt = block_table if paged else seq_lens
    grid = (work_req.numel(), num_heads)
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        query_start_loc,
        seq_lens,
        bt,
        work_req,
        work_mblock,
        query_positions if query_positions is not None else seq_lens,
        bias,
        *bstrides,
        kv_scales[0] if kv_scales is not None else q,  # unused pointers without fp8
        kv_scales[1] if kv_scales is not None else q,
        kv_scales[0].stride(0) if kv_scales is not None else 0,
        q.stride(0),
        q.stride(1),
        k.stride(-3),
        k.stride(-2),
        v.stride(-3),
        v.stride(-2),
        out.stride(0),
        out.stride(1),
        bt.stride(0) if paged else 0,
        scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGED=paged,
        PAGE=page_size,
        CAUSAL=causal,
        BIAS_MODE=bias_mode,
        **rel,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_KV=kv_scales is not None,
        num_warps=launch[0],
        num_stages=launch[1],
    )
    return out
