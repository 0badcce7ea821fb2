"""Triton kernel of absorbed cross-attention: projected queries q' [T, H, d] attend over a
request's paged encoder states E in one pass per (request, query block, row tile).
Must hold: results equal the torch reference `attend_encoder_states_torch` in
`ops/absorbed_cross_attention.py` (which also runs the W_k / W_v GEMMs around this kernel).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_R = 16
"""(token, head) rows per program: 16 is tl.dot's smallest M."""
CHUNK = 256
"""Columns of E per dot operand (128 and 256 tie at BART's d = 1024; 256 keeps 1280 in 5)."""
MAX_CHUNKS = 5
"""Accumulators a program keeps (d <= 1280 at CHUNK; wider models take wider chunks)."""
NUM_WARPS, NUM_STAGES = 8, 2
"""Best of 8/16 warps, 1/2 stages, 16/32-row tiles, 32/64 positions and 128/256-column chunks
at large-v3 and BART decode shapes on an H100 (benchmarks/RESULTS.md, session 8)."""


@triton.jit
def _load_chunk(Ptr, rows, row_mask, c: tl.constexpr, CHUNK: tl.constexpr, D_MODEL: tl.constexpr):
    """Columns [c * CHUNK, (c + 1) * CHUNK) of the rows starting at `rows` (element offsets
    into Ptr: query rows, or a block of encoder-state rows), [M, CHUNK]."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    return tl.load(
        Ptr + rows[:, None] + offs[None, :],
        mask=row_mask[:, None] & (offs < D_MODEL)[None, :],
        other=0.0,
    )


@triton.jit
def _score_chunk(
    Q,
    q_rows,
    r_mask,
    States,
    base,
    n_mask,
    c: tl.constexpr,
    CHUNK: tl.constexpr,
    D_MODEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Chunk c's share of the scores, q'[:, c] E[:, c]^T: [R, N]."""
    q = _load_chunk(Q, q_rows, r_mask, c, CHUNK, D_MODEL)
    e = _load_chunk(States, base, n_mask, c, CHUNK, D_MODEL).to(q.dtype)
    return tl.dot(q, tl.trans(e), input_precision=DOT_PRECISION)


@triton.jit
def _update_chunk(
    acc,
    alpha,
    p,
    States,
    base,
    n_mask,
    c: tl.constexpr,
    CHUNK: tl.constexpr,
    D_MODEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Chunk c of the context [R, CHUNK], rescaled by alpha, plus P E[:, c]. The load repeats
    the scores' load of the same block, which the pipeline keeps on chip."""
    e = _load_chunk(States, base, n_mask, c, CHUNK, D_MODEL).to(p.dtype)
    return acc * alpha[:, None] + tl.dot(p, e, input_precision=DOT_PRECISION)


@triton.jit
def _store_chunk(
    Out, o_rows, r_mask, acc, inv_l, c: tl.constexpr, CHUNK: tl.constexpr, D_MODEL: tl.constexpr
):
    offs = c * CHUNK + tl.arange(0, CHUNK)
    tl.store(
        Out + o_rows[:, None] + offs[None, :],
        (acc * inv_l[:, None]).to(Out.dtype.element_ty),
        mask=r_mask[:, None] & (offs < D_MODEL)[None, :],
    )


@triton.jit
def _positions(
    block_table, req, stride_bt, offs_n, n_mask, SPAN: tl.constexpr, ROWS_PER_HALF: tl.constexpr
):
    """(pool tensor, half, block, row) of encoder positions `offs_n` of request `req`, int64
    (pools exceed 2^31 elements)."""
    block = tl.load(
        block_table + req * stride_bt + offs_n // (SPAN * 2 * ROWS_PER_HALF), mask=n_mask, other=0
    ).to(tl.int64)
    offset = offs_n % (SPAN * 2 * ROWS_PER_HALF)
    pool_tensor = (offset // (2 * ROWS_PER_HALF)).to(tl.int64)
    half = ((offset // ROWS_PER_HALF) % 2).to(tl.int64)
    row = (offset % ROWS_PER_HALF).to(tl.int64)
    return pool_tensor, half, block, row


@triton.jit
def _scores(
    Q,
    q_rows,
    r_mask,
    States,
    base,
    n_mask,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    D_MODEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """q' E^T over every column chunk: [R, N]."""
    s = _score_chunk(Q, q_rows, r_mask, States, base, n_mask, 0, CHUNK, D_MODEL, DOT_PRECISION)
    if NUM_CHUNKS > 1:
        s += _score_chunk(Q, q_rows, r_mask, States, base, n_mask, 1, CHUNK, D_MODEL, DOT_PRECISION)
    if NUM_CHUNKS > 2:
        s += _score_chunk(Q, q_rows, r_mask, States, base, n_mask, 2, CHUNK, D_MODEL, DOT_PRECISION)
    if NUM_CHUNKS > 3:
        s += _score_chunk(Q, q_rows, r_mask, States, base, n_mask, 3, CHUNK, D_MODEL, DOT_PRECISION)
    if NUM_CHUNKS > 4:
        s += _score_chunk(Q, q_rows, r_mask, States, base, n_mask, 4, CHUNK, D_MODEL, DOT_PRECISION)
    return s


@triton.jit
def _weights(
    s, m_i, l_i, n_mask, Scales, pool_tensor, half, block, row, stride_sc_tensor,
    stride_sc_half, stride_sc_block, FP8: tl.constexpr,
):  # fmt: skip
    """One block of positions into the online softmax: (P [R, N] in float32, alpha, the new
    running max and sum). fp8 states: E[n] = scale[n] * stored[n], so the scale multiplies
    column n of the scores, and the weight of row n in P E."""
    if FP8:
        scale = tl.load(
            Scales
            + pool_tensor * stride_sc_tensor
            + half * stride_sc_half
            + block * stride_sc_block
            + row,
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
    return p, alpha, m_new, l_i


# Every head of every query token attends over the same E (multi-query attention of width
# d = d_model), so a program takes a tile of BLOCK_R (token, head) rows of one request and
# streams that request's E once: scores = q' E^T, online softmax, P E, for all its rows together.
#
# Chunking: d is cut into up to MAX_CHUNKS power-of-two column chunks (1280 = 5 x 256), each with
# its own accumulator: the scores sum the chunks' q'[:, c] E[:, c]^T, then P E updates each
# chunk's accumulator from the same block of E. No dot operand is d wide: the earlier kernel's
# [N, 1024] + [N, 256] operands took all 255 registers a thread and spilled.
#
# The grid is one-dimensional with the row tiles of a work item adjacent, so the tiles of one
# request (large-v3's 20 heads are two tiles of 16 rows) run at the same time and the second
# reads E from L2, not HBM. fp8 encoder states load as fp8 and convert to the query's dtype;
# their per-position scales fold into the scores and the softmax weights (no [N, d] multiply).
#
# Cache layout: states [span, 2, num_blocks, rows_per_half, d] (+ scales [span, 2, num_blocks,
# rows_per_half]); position p of a request: block table entry p // (span * 2 * rows_per_half),
# offset o = p % (span * 2 * rows_per_half) in pool tensor o // (2 * rows_per_half), and there in
# half (o // rows_per_half) % 2, row o % rows_per_half.
@triton.jit
def _absorbed_attention_kernel(
    Q, States, Scales, Out, query_start_loc, seq_lens, block_table, work_req, work_mblock,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_s_tensor, stride_s_half, stride_s_block, stride_s_row,
    stride_sc_tensor, stride_sc_half, stride_sc_block, stride_bt,
    NUM_HEADS: tl.constexpr, D_MODEL: tl.constexpr, CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, ROWS_PER_HALF: tl.constexpr, SPAN: tl.constexpr,
    QUERY_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_TILES: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):  # fmt: skip
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
    # One accumulator per column chunk (constexpr branches: the unused ones are never built).
    acc0 = tl.zeros([BLOCK_R, CHUNK], tl.float32)
    if NUM_CHUNKS > 1:
        acc1 = tl.zeros([BLOCK_R, CHUNK], tl.float32)
    if NUM_CHUNKS > 2:
        acc2 = tl.zeros([BLOCK_R, CHUNK], tl.float32)
    if NUM_CHUNKS > 3:
        acc3 = tl.zeros([BLOCK_R, CHUNK], tl.float32)
    if NUM_CHUNKS > 4:
        acc4 = tl.zeros([BLOCK_R, CHUNK], tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)

    for start_n in tl.range(0, kv_len, BLOCK_N, num_stages=LOOP_STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        pool_tensor, half, block, row = _positions(
            block_table, req, stride_bt, offs_n, n_mask, SPAN, ROWS_PER_HALF
        )
        base = (
            pool_tensor * stride_s_tensor
            + half * stride_s_half
            + block * stride_s_block
            + row * stride_s_row
        )
        s = _scores(
            Q, q_rows, r_mask, States, base, n_mask, CHUNK, NUM_CHUNKS, D_MODEL, DOT_PRECISION
        )
        p, alpha, m_i, l_i = _weights(
            s, m_i, l_i, n_mask, Scales, pool_tensor, half, block, row, stride_sc_tensor,
            stride_sc_half, stride_sc_block, FP8,
        )  # fmt: skip
        p = p.to(Q.dtype.element_ty)
        acc0 = _update_chunk(acc0, alpha, p, States, base, n_mask, 0, CHUNK, D_MODEL, DOT_PRECISION)
        if NUM_CHUNKS > 1:
            acc1 = _update_chunk(
                acc1, alpha, p, States, base, n_mask, 1, CHUNK, D_MODEL, DOT_PRECISION
            )
        if NUM_CHUNKS > 2:
            acc2 = _update_chunk(
                acc2, alpha, p, States, base, n_mask, 2, CHUNK, D_MODEL, DOT_PRECISION
            )
        if NUM_CHUNKS > 3:
            acc3 = _update_chunk(
                acc3, alpha, p, States, base, n_mask, 3, CHUNK, D_MODEL, DOT_PRECISION
            )
        if NUM_CHUNKS > 4:
            acc4 = _update_chunk(
                acc4, alpha, p, States, base, n_mask, 4, CHUNK, D_MODEL, DOT_PRECISION
            )

    o_rows = token * stride_ot + head * stride_oh
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # no keys (graph padding): zeros
    _store_chunk(Out, o_rows, r_mask, acc0, inv_l, 0, CHUNK, D_MODEL)
    if NUM_CHUNKS > 1:
        _store_chunk(Out, o_rows, r_mask, acc1, inv_l, 1, CHUNK, D_MODEL)
    if NUM_CHUNKS > 2:
        _store_chunk(Out, o_rows, r_mask, acc2, inv_l, 2, CHUNK, D_MODEL)
    if NUM_CHUNKS > 3:
        _store_chunk(Out, o_rows, r_mask, acc3, inv_l, 3, CHUNK, D_MODEL)
    if NUM_CHUNKS > 4:
        _store_chunk(Out, o_rows, r_mask, acc4, inv_l, 4, CHUNK, D_MODEL)


def column_chunks(d_model: int) -> tuple[int, int]:
    """(chunk, num_chunks): power-of-two column chunks, 16 to CHUNK wide (wider past
    MAX_CHUNKS * CHUNK columns), covering d_model in at most MAX_CHUNKS."""
    chunk = max(16, min(CHUNK, triton.next_power_of_2(d_model)))
    chunk = max(chunk, triton.next_power_of_2(triton.cdiv(d_model, MAX_CHUNKS)))
    return chunk, triton.cdiv(d_model, chunk)


def attend_encoder_states_triton(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    metadata: Any,
    block_r: int = BLOCK_R,
    block_n: int | None = None,
) -> torch.Tensor:
    """q' [T, H, d] (scale folded in) over each request's encoder states -> context [T, H, d].
    `metadata` is the Triton backend's (work items of `block_m` query rows per request),
    built with the encoder-states block size."""
    common = metadata.common
    num_heads, d_model = q_abs.shape[1], q_abs.shape[2]
    assert q_abs.stride(2) == 1 and states.stride(4) == 1
    out = torch.zeros_like(q_abs)
    work_req, work_mblock = metadata.work
    if work_req.numel() == 0:
        return out
    chunk, num_chunks = column_chunks(d_model)
    if block_n is None:
        block_n = 64 if d_model > 1024 else 32
    if q_abs.element_size() * d_model > 2 * 1280:  # fp32 wide models: fit shared memory
        block_n = min(block_n, 16)
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
        states.stride(3),
        scales.stride(0) if fp8 else 0,
        scales.stride(1) if fp8 else 0,
        scales.stride(2) if fp8 else 0,
        common.block_table.stride(0),
        NUM_HEADS=num_heads,
        D_MODEL=d_model,
        CHUNK=chunk,
        NUM_CHUNKS=num_chunks,
        ROWS_PER_HALF=states.shape[3],
        SPAN=states.shape[0],
        QUERY_BLOCK=metadata.block_m,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        NUM_TILES=num_tiles,
        FP8=fp8,
        DOT_PRECISION="ieee" if q_abs.dtype == torch.float32 else "tf32",
        LOOP_STAGES=NUM_STAGES,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
