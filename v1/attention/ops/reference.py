"""Plain-torch reference ops: the KV cache write and naive per-request attention.

These are the test oracles for every backend and kernel; clarity over speed.
"""

from __future__ import annotations

import math

import torch

from v1.quantization.fp8_rows import quantize_rows


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter key/value rows [N, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    flat slots (block_id * block_size + offset); slot -1 skips the row. An fp8 cache (with
    `kv_scales` [2, num_blocks, block_size, Hkv]) stores each head's row quantized with its
    own scale."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    rows = [key[: slot_mapping.shape[0]][valid], value[: slot_mapping.shape[0]][valid]]
    for half, row in enumerate(rows):
        if kv_scales is None:
            flat[half].index_copy_(0, slots, row.to(kv_cache.dtype))
            continue
        q, scale = quantize_rows(row)  # [n, Hkv, D], [n, Hkv]
        # Byte views: CPU index_copy_ has no float8 kernel.
        flat[half].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        kv_scales[half].view(num_blocks * block_size, -1).index_copy_(0, slots, scale)


def read_kv_rows(
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    half: int,
    slots: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """K (half 0) or V (half 1) rows at flat `slots` (any shape) -> [*slots.shape, Hkv, D] in
    `dtype`, dequantized when the cache is fp8."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    rows = kv_cache[half].view(num_blocks * block_size, *kv_cache.shape[3:])[slots]
    if kv_scales is None:
        return rows.to(dtype)
    scale = kv_scales[half].view(num_blocks * block_size, -1)[slots]
    return (rows.float() * scale[..., None]).to(dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: list[int] | torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` K and V rows [length, Hkv, D] of one request's blocks."""
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    k = kv_cache[0, blocks].flatten(0, 1)[:length]
    v = kv_cache[1, blocks].flatten(0, 1)[:length]
    return k, v


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q [Q, H, D], k/v [K, Hkv, D]; causal aligns the last query with the last
    key (query j sits at position K - Q + j). bias [H, Q, K] is added to the scores."""
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1).float()
    v = v.repeat_interleave(rep, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, Q, K]
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        q_pos = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
        k_pos = torch.arange(num_k, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, -math.inf)
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
