"""Triton kernel of absorbed cross-attention: projected queries attend over the paged encoder
states E in one pass per (request, query block, row tile).

Every head of every query token attends over the same E (multi-query attention of width d =
d_model), so a program takes a tile of BLOCK_R (token, head) rows of one request and streams
that request's E once: scores = q' E^T, online softmax, P E, for all its rows together. The
query projection q' = q W_k^T and W_v after run as batched GEMMs around the kernel
(`ops/absorbed_cross_attention.py`, whose torch path is this kernel's reference). The width d
is covered by two power-of-two chunks (1280 = 1024 + 256, 768 = 512 + 256), so no lane of a
1280-wide model is padded to 2048.

The grid is one-dimensional with the row tiles of a work item adjacent, so the tiles of one
request (large-v3's 20 heads are two tiles of 16 rows) run at the same time and the second
reads E from L2, not HBM. fp8 encoder states load as fp8 and convert to the query's dtype; their
per-position scales fold into the scores and the softmax weights (no [N, d] multiply).
Measured on an H100 (256 requests x 1500 positions x 1280, bf16;
`benchmarks/absorbed_kernel.py`): 639 us per call, 1,538 GB/s of E, against 1,143 us for the
previous grid order with BLOCK_N 32; one read of E takes 330 us.

Cache layout: states [2, num_blocks, rows_per_half, d] (+ scales [2, num_blocks,
rows_per_half]); position p of a request: block table entry p // (2 * rows_per_half), offset
o = p % (2 * rows_per_half) in half o // rows_per_half, row o % rows_per_half.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_R = 16
"""(token, head) rows per program: 16 is tl.dot's smallest M."""
BLOCK_N = 64
"""Encoder positions per inner step (64 beat 16 and 32 by 1.5x at large-v3 shapes; 128 does
not fit shared memory at d = 1280)."""
NUM_WARPS, NUM_STAGES = 8, 3
"""Best of 4/8/16 warps and 2/3/4 stages at large-v3 decode shapes on an H100."""


@triton.jit
def _load_states(
    States,
    base,
    offs_d,
    n_mask,
    D_MODEL: tl.constexpr,
):
    return tl.load(
        States + base[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & (offs_d < D_MODEL)[None, :],
        other=0.0,
    )


@triton.jit
def _absorbed_attention_kernel(
    Q,
    States,
    Scales,
    Out,
    query_start_loc,
    seq_lens,
    block_table,
    work_req,
    work_mblock,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_s_half,
    stride_s_block,
    stride_s_row,
    stride_sc_half,
    stride_sc_block,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    D_MODEL: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    HAS_B: tl.constexpr,
    ROWS_PER_HALF: tl.constexpr,
    QUERY_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_TILES: tl.constexpr,
    FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Row tiles of one work item are adjacent programs: they share E through L2.
    pid = tl.program_id(0) // NUM_TILES
    tile = tl.program_id(0) % NUM_TILES
    req = tl.load(work_req + pid)
    mblock = tl.load(work_mblock + pid)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    kv_len = tl.load(seq_lens + req)
    first_token = mblock * QUERY_BLOCK
    num_tokens = tl.minimum(q_len - first_token, QUERY_BLOCK)
    if tile * BLOCK_R >= num_tokens * NUM_HEADS:
        return  # this query block has fewer (token, head) rows than the grid allows for

    # Row r of the tile: token (first_token + g // H), head g % H, g = tile * BLOCK_R + r.
    g = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = g < num_tokens * NUM_HEADS
    token = (q_start + first_token + g // NUM_HEADS).to(tl.int64)
    head = g % NUM_HEADS
    q_rows = token * stride_qt + head * stride_qh
    offs_a = tl.arange(0, BLOCK_DA)
    a_mask = r_mask[:, None] & (offs_a < D_MODEL)[None, :]
    q_a = tl.load(Q + q_rows[:, None] + offs_a[None, :], mask=a_mask, other=0.0)
    acc_a = tl.zeros([BLOCK_R, BLOCK_DA], tl.float32)
    if HAS_B:
        offs_b = BLOCK_DA + tl.arange(0, BLOCK_DB)
        b_mask = r_mask[:, None] & (offs_b < D_MODEL)[None, :]
        q_b = tl.load(Q + q_rows[:, None] + offs_b[None, :], mask=b_mask, other=0.0)
        acc_b = tl.zeros([BLOCK_R, BLOCK_DB], tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)

    n_hi = tl.minimum(tl.cdiv(kv_len, BLOCK_N) * BLOCK_N, kv_len)
    for start_n in range(0, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        block = tl.load(
            block_table + req * stride_bt + offs_n // (2 * ROWS_PER_HALF), mask=n_mask, other=0
        ).to(tl.int64)
        offset = offs_n % (2 * ROWS_PER_HALF)
        half = (offset // ROWS_PER_HALF).to(tl.int64)  # int64: pools exceed 2^31 elements
        row = (offset % ROWS_PER_HALF).to(tl.int64)
        base = half * stride_s_half + block * stride_s_block + row * stride_s_row
        e_a = _load_states(States, base, offs_a, n_mask, D_MODEL).to(q_a.dtype)  # [N, DA]
        s = tl.dot(q_a, tl.trans(e_a), input_precision=DOT_PRECISION)  # [R, N]
        if HAS_B:
            e_b = _load_states(States, base, offs_b, n_mask, D_MODEL).to(q_b.dtype)  # [N, DB]
            s += tl.dot(q_b, tl.trans(e_b), input_precision=DOT_PRECISION)
        if FP8:
            # E[n] = scale[n] * stored[n]: the scale multiplies column n of the scores, and
            # the weight of row n in P E.
            scale = tl.load(
                Scales + half * stride_sc_half + block * stride_sc_block + row,
                mask=n_mask,
                other=0.0,
            )
            s = s * scale[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * scale[None, :]
        acc_a = acc_a * alpha[:, None] + tl.dot(p.to(e_a.dtype), e_a, input_precision=DOT_PRECISION)
        if HAS_B:
            acc_b = acc_b * alpha[:, None] + tl.dot(
                p.to(e_b.dtype), e_b, input_precision=DOT_PRECISION
            )
        m_i = m_new

    o_rows = token * stride_ot + head * stride_oh
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # no keys (graph padding): zeros
    tl.store(
        Out + o_rows[:, None] + offs_a[None, :],
        (acc_a * inv_l[:, None]).to(Out.dtype.element_ty),
        mask=a_mask,
    )
    if HAS_B:
        tl.store(
            Out + o_rows[:, None] + offs_b[None, :],
            (acc_b * inv_l[:, None]).to(Out.dtype.element_ty),
            mask=b_mask,
        )


def width_chunks(d_model: int) -> tuple[int, int]:
    """(BLOCK_DA, BLOCK_DB): the largest power of two <= d_model, and a second power-of-two
    chunk (>= 16, tl.dot's smallest K) covering the rest; 0 when the first covers it all."""
    first = 1 << (d_model.bit_length() - 1)
    rest = d_model - first
    return max(first, 16), (max(triton.next_power_of_2(rest), 16) if rest else 0)


def attend_encoder_states_triton(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    metadata: Any,
    block_r: int = BLOCK_R,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """q' [T, H, d] (scale folded in) over each request's encoder states -> context [T, H, d].
    `metadata` is the Triton backend's (work items of `block_m` query rows per request),
    built with the encoder-states block size."""
    common = metadata.common
    num_heads, d_model = q_abs.shape[1], q_abs.shape[2]
    assert q_abs.stride(2) == 1 and states.stride(3) == 1
    out = torch.zeros_like(q_abs)
    work_req, work_mblock = metadata.work
    if work_req.numel() == 0:
        return out
    block_da, block_db = width_chunks(d_model)
    num_stages = NUM_STAGES
    if q_abs.element_size() * d_model > 2 * 1280:  # fp32 wide models: fit shared memory
        block_n, num_stages = min(block_n, 16), 2
    num_tiles = triton.cdiv(metadata.block_m * num_heads, block_r)
    grid = (work_req.numel() * num_tiles,)
    fp8 = scales is not None
    _absorbed_attention_kernel[grid](
        q_abs,
        states,
        scales if fp8 else states,  # an unused pointer without fp8
        out,
        common.query_start_loc,
        common.seq_lens,
        common.block_table,
        work_req,
        work_mblock,
        q_abs.stride(0),
        q_abs.stride(1),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        scales.stride(0) if fp8 else 0,
        scales.stride(1) if fp8 else 0,
        common.block_table.stride(0),
        NUM_HEADS=num_heads,
        D_MODEL=d_model,
        BLOCK_DA=block_da,
        BLOCK_DB=max(block_db, 16),
        HAS_B=block_db > 0,
        ROWS_PER_HALF=states.shape[2],
        QUERY_BLOCK=metadata.block_m,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        NUM_TILES=num_tiles,
        FP8=fp8,
        DOT_PRECISION="ieee" if q_abs.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=num_stages,
    )
    return out
