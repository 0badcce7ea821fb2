"""Triton kernel of rotary position embedding (neox / rotate-half style) for q and k in one
launch, cos and sin computed inside from the inverse frequencies, held to the torch
reference: `RotaryEmbedding.forward` off the fused path (`v1.models.layers.rotary`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # the precise (libdevice) cos and sin: tl.cos is the approximate PTX instruction on CUDA
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - an older Triton
    from triton.language import math as libdevice


@triton.jit
def _rotate_heads(
    X,
    Out,
    row,
    stride_x,
    stride_o,
    position,
    InvFreq,
    LongInvFreq,
    long_from,
    scaling,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LONG: tl.constexpr,
    PRECISE: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    rotated = cols < 2 * HALF
    first = cols < HALF
    # The partner of column c in rotate_half: c + HALF in the first half, c - HALF in the
    # second; columns past rotary_dim pass through (their own column, never multiplied).
    partner = tl.where(first, cols + HALF, tl.where(rotated, cols - HALF, cols))
    freq_idx = tl.where(first, cols, cols - HALF)
    inv_freq = tl.load(InvFreq + freq_idx, mask=rotated, other=0.0)
    if HAS_LONG:
        long_inv_freq = tl.load(LongInvFreq + freq_idx, mask=rotated, other=0.0)
        inv_freq = tl.where(position >= long_from, long_inv_freq, inv_freq)
    emb = position.to(tl.float32) * inv_freq  # float32, as positions.float() * inv_freq
    dtype = X.dtype.element_ty
    if PRECISE:
        cos, sin = libdevice.cos(emb), libdevice.sin(emb)
    else:  # Triton's interpreter (CPU tests) has no libdevice; its tl.cos is numpy's
        cos, sin = tl.cos(emb), tl.sin(emb)
    cos = (cos * scaling).to(dtype).to(tl.float32)
    sin = (sin * scaling).to(dtype).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HEAD_SIZE)
    base = X + row * stride_x + heads[:, None] * HEAD_SIZE
    x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    # rot * cos + rotate_half(rot) * sin with the torch path's three roundings.
    a = (x * cos[None, :]).to(dtype).to(tl.float32)
    b = (sign[None, :] * xp * sin[None, :]).to(dtype).to(tl.float32)
    y = tl.where(rotated[None, :], (a + b).to(dtype), x.to(dtype))
    tl.store(Out + row * stride_o + heads[:, None] * HEAD_SIZE + cols[None, :], y, mask=mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    QOut,
    KOut,
    Positions,
    InvFreq,
    LongInvFreq,
    long_from,
    stride_q,
    stride_k,
    stride_qo,
    stride_ko,
    num_q_heads,
    num_k_heads,
    scaling,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LONG: tl.constexpr,
    PRECISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(Positions + row)
    _rotate_heads(
        Q, QOut, row, stride_q, stride_qo, position, InvFreq, LongInvFreq, long_from, scaling,
        num_q_heads,
        HEAD_SIZE, HALF, BLOCK_QH, BLOCK_D, HAS_LONG, PRECISE,
    )  # fmt: skip
    _rotate_heads(
        K, KOut, row, stride_k, stride_ko, position, InvFreq, LongInvFreq, long_from, scaling,
        num_k_heads,
        HEAD_SIZE, HALF, BLOCK_KH, BLOCK_D, HAS_LONG, PRECISE,
    )  # fmt: skip


def _interpreted(kernel: object) -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(kernel, InterpretedFunction)


def rope_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    long_inv_freq: torch.Tensor | None = None,
    long_from: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (integer), query [T, H*D], key [T, Hkv*D] (same 16-bit dtype; rows may
    be strided, e.g. chunks of a fused qkv projection, columns contiguous) -> the rotated
    query and key as new contiguous tensors; the inputs are not written.

    Per token and rotated column c (rotary_dim = 2 * len(inv_freq) <= head_size), with
    half = rotary_dim / 2 and the torch path's rounding points:

        emb      = float(position) * inv_freq[c % half]      float32
        cos, sin = cos(emb) * scaling, sin(emb) * scaling     float32, rounded to the dtype
        out[c]   = x[c] * cos - x[c + half] * sin             c < half
        out[c]   = x[c] * cos + x[c - half] * sin             half <= c < rotary_dim
        out[c]   = x[c]                                       c >= rotary_dim

    each product rounded to the dtype and then their sum. `long_inv_freq` replaces inv_freq
    for tokens at positions >= `long_from` (longrope). One launch replaces the torch path's
    cos/sin computation (per layer) and its slice, neg, cat, mul and add per tensor."""
    assert query.dim() == 2 and key.dim() == 2, (query.shape, key.shape)
    assert query.stride(1) == 1 and key.stride(1) == 1
    assert query.dtype == key.dtype
    num_tokens = query.shape[0]
    assert key.shape[0] == num_tokens and positions.shape == (num_tokens,)
    assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
    half = inv_freq.shape[0]
    assert 2 * half <= head_size
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    num_q_heads, num_k_heads = query.shape[1] // head_size, key.shape[1] // head_size
    block_d = triton.next_power_of_2(head_size)
    elements = triton.next_power_of_2(num_q_heads) * block_d
    _rope_kernel[(num_tokens,)](
        query,
        key,
        q_out,
        k_out,
        positions,
        inv_freq,
        long_inv_freq if long_inv_freq is not None else inv_freq,
        long_from if long_from is not None else 0,
        query.stride(0),
        key.stride(0),
        q_out.stride(0),
        k_out.stride(0),
        num_q_heads,
        num_k_heads,
        float(attention_scaling),
        HEAD_SIZE=head_size,
        HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_D=block_d,
        HAS_LONG=long_inv_freq is not None,
        PRECISE=not _interpreted(_rope_kernel),
        num_warps=8 if elements >= 4096 else 4,
    )
    return q_out, k_out
