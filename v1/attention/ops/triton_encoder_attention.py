"""Triton kernel: bidirectional attention over packed sequences (encoder-only models: BERT,
RoBERTa, XLM-R), q/k/v [T, H, D] rows sharing one set of cumulative offsets, each row of a
sequence attending to every row of it. Specialised where the general paged kernel
(`triton_attention._attention_kernel`) is not: no block table, no bias, no causal mask, the
softmax in base 2 with the scale folded in, and the key loop unmasked but for its last block.
Must hold: results equal `ops/reference.py`'s packed reference (and aten's flash varlen).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1.attention.ops.encoder_tiles import query_tiles

LOG2E = 1.4426950408889634

# Tile sizes per head size, from `benchmarks/bert_attention.py --sweep` on an H200 (fp16,
# bert_embed.py's workloads: head size 64 over 16-512 tokens, 32 over 16-256): (BLOCK_M,
# BLOCK_N, num_warps, num_stages). Head sizes not listed keep aten's flash varlen.
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    32: (64, 32, 4, 4),
    64: (64, 64, 4, 3),
}
MAX_LEN = 2048
"""Longest sequence measured (160 against aten flash's 218 ms over inputs of 16-2048 tokens,
H200): steps with longer inputs keep aten's flash varlen."""


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def supports(head_dim: int, max_seq_len: int) -> bool:
    """Whether the kernel was measured on this head size (CONFIGS) and sequence length."""
    return head_dim in CONFIGS and max_seq_len <= MAX_LEN


def tile_rows(head_dim: int) -> int:
    """Query rows per tile for a head size (the `block_m` of `query_tiles`)."""
    return CONFIGS[head_dim][0]


@triton.jit
def _load_rows(ptrs, row_mask, d_mask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile, masked only where a mask can be false."""
    if MASK_ROWS and EVEN_D:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _key_block(
    q,
    acc,
    m_i,
    l_i,
    k_ptrs,
    v_ptrs,
    offs_n,
    start_n,
    seq_len,
    d_mask,
    stride_kt,
    stride_vt,
    qk_scale,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """One block of keys into the running softmax (m_i, l_i) and output (acc)."""
    n_mask = (start_n + offs_n) < seq_len
    k = _load_rows(k_ptrs + start_n * stride_kt, n_mask, d_mask, MASKED, EVEN_D)
    v = _load_rows(v_ptrs + start_n * stride_vt, n_mask, d_mask, MASKED, EVEN_D)
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _encoder_attention_kernel(
    Q,
    K,
    V,
    Out,
    cu_seqlens,
    tiles,
    num_tiles,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tiles + tile)
    if seq >= num_seqs:
        return  # a spare tile (the grid is sized for the most tiles a step can have)
    mblock = tl.load(tiles + num_tiles + tile)
    start = tl.load(cu_seqlens + seq)
    seq_len = tl.load(cu_seqlens + seq + 1) - start
    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < seq_len
    d_mask = offs_d < HEAD_DIM
    rows = (start + offs_m).to(tl.int64)
    q_ptrs = Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = _load_rows(q_ptrs, m_mask, d_mask, True, EVEN_D)
    key_rows = (start + offs_n).to(tl.int64)
    k_ptrs = K + key_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :]
    v_ptrs = V + key_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full = seq_len // BLOCK_N * BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _key_block(
            q, acc, m_i, l_i, k_ptrs, v_ptrs, offs_n, start_n, seq_len, d_mask,
            stride_kt, stride_vt, qk_scale, MASKED=False, EVEN_D=EVEN_D,
        )  # fmt: skip
    if full < seq_len:
        acc, m_i, l_i = _key_block(
            q, acc, m_i, l_i, k_ptrs, v_ptrs, offs_n, full, seq_len, d_mask,
            stride_kt, stride_vt, qk_scale, MASKED=True, EVEN_D=EVEN_D,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    tiles: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Bidirectional attention of packed rows q/k/v [T, H, D] (rows may be strided, the last
    dim contiguous) over the sequences `cu_seqlens` [S + 1] (int32) delimits (empty
    sequences, as a CUDA graph's padded offsets hold, are fine). `tiles`:
    `encoder_tiles.query_tiles(cu_seqlens, T, tile_rows(D))`, made once per step for all
    layers (made here if None). Rows past `cu_seqlens[-1]` are left unwritten."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cu_seqlens.shape[0] < 2:
        return out
    if config is None and q.shape[2] not in CONFIGS:
        raise ValueError(f"no tile configuration for head size {q.shape[2]} (see CONFIGS)")
    block_m, block_n, warps, stages = config or CONFIGS[q.shape[2]]
    head_dim, block_d = q.shape[2], _block_d(q.shape[2])
    if tiles is None:
        tiles = query_tiles(cu_seqlens, q.shape[0], block_m)
    num_tiles = tiles.shape[1]
    _encoder_attention_kernel[(num_tiles, q.shape[1])](
        q,
        k,
        v,
        out,
        cu_seqlens,
        tiles,
        num_tiles,
        cu_seqlens.shape[0] - 1,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        EVEN_D=block_d == head_dim,
        num_warps=warps,
        num_stages=stages,
    )
    return out
