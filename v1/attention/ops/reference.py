"""Plain-torch reference ops: the KV cache write and naive per-request attention.

These are the test oracles for every backend and kernel; clarity over speed.
"""

from __future__ import annotations

import math

import torch


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value rows [N, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    flat slots (block_id * block_size + offset); slot -1 skips the row."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, key[: slot_mapping.shape[0]][valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[: slot_mapping.shape[0]][valid].to(kv_cache.dtype))


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
