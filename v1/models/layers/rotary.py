"""Rotary position embedding (neox / rotate-half style) with the scaling variants of transformers.

Inverse frequencies and the attention scaling come from `transformers.modeling_rope_utils
.ROPE_INIT_FUNCTIONS`, so every rope type there (linear, dynamic, yarn, llama3, longrope, ...)
matches Hugging Face. Positions are given per token, so a packed batch needs no padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from v1.models.layers.norm import use_fused_elementwise


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` dims of every head of q and k by position.

    `long_inv_freq` (longrope) is used for tokens at positions >= `long_from`: chosen per token,
    so a request's result never depends on what else is in the batch."""

    def __init__(
        self,
        head_size: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = 2 * inv_freq.shape[0]
        if self.rotary_dim > head_size:
            raise ValueError(f"rotary dim {self.rotary_dim} exceeds head size {head_size}")
        self.attention_scaling = float(attention_scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.long_from = long_from
        if long_inv_freq is not None:
            self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        else:
            self.long_inv_freq = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> cos, sin [T, rotary_dim] (computed in float32 like transformers)."""
        pos = positions.float()[:, None]  # [T, 1]
        inv_freq = self.inv_freq[None, :]  # [1, rotary_dim / 2]
        if self.long_inv_freq is not None:
            is_long = positions[:, None] >= self.long_from  # [T, 1]
            inv_freq = torch.where(is_long, self.long_inv_freq[None, :], inv_freq)
        freqs = pos * inv_freq  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)  # [T, heads, head_size]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rotary_dim]
        rot = rot * cos + rotate_half(rot) * sin
        return torch.cat((rot, rest), dim=-1).view(num_tokens, -1)  # [T, heads * head_size]

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; query [T, H*D], key [T, Hkv*D] -> rotated, same shapes (new
        tensors). One Triton kernel (`triton_rotary.py`, cos and sin computed inside) under
        `use_fused_elementwise`; the torch path is its reference."""
        if (
            use_fused_elementwise(query)
            and use_fused_elementwise(key)
            and positions.is_cuda
            and positions.dim() == 1
            and positions.shape[0] == query.shape[0]
        ):
            from v1.models.layers.triton_rotary import rope_triton

            return rope_triton(
                positions,
                query,
                key,
                self.head_size,
                self.inv_freq,
                self.attention_scaling,
                self.long_inv_freq,
                self.long_from,
            )
        cos, sin = self.cos_sin(positions, query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"attention_scaling={self.attention_scaling}"
        )


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rope parameters in transformers' standard form (rope_type, rope_theta, ...)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # configs that never went through transformers' standardization
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def get_rope(hf_config: Any, head_size: int) -> RotaryEmbedding:
    """The rotary embedding a Hugging Face config asks for.

    dynamic: frequencies fixed for the longest extended length (max_position_embeddings *
    factor, as vLLM does) instead of recomputed per batch length: a KV cache holds keys rotated
    once, so the frequencies must not change during a request."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if rope_type == "default":
        dim = int(head_size * partial)
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return RotaryEmbedding(head_size, inv_freq)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: default, {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    init_fn = ROPE_INIT_FUNCTIONS[rope_type]
    if rope_type == "dynamic":
        max_len = int(hf_config.max_position_embeddings * params["factor"])
        inv_freq, scaling = init_fn(hf_config, seq_len=max_len)
        return RotaryEmbedding(head_size, inv_freq, scaling)
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        inv_freq, scaling = init_fn(hf_config, seq_len=None)
        long_inv_freq, _ = init_fn(hf_config, seq_len=original + 1)
        return RotaryEmbedding(head_size, inv_freq, scaling, long_inv_freq, long_from=original)
    inv_freq, scaling = init_fn(hf_config)
    return RotaryEmbedding(head_size, inv_freq, scaling)
