"""Multi-head attention blocks shared by the encoder-decoder models (BART family, Whisper)."""

from __future__ import annotations

import torch
from torch import nn

from v1.attention.backend import AttentionType
from v1.attention.cross_attention import EncoderDecoderAttention
from v1.attention.layer import Attention
from v1.models.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear


class SelfAttention(nn.Module):
    """Bidirectional (encoder) or causal paged (decoder) self-attention with fused q/k/v."""

    def __init__(self, d_model: int, num_heads: int, attn_type: AttentionType, prefix: str) -> None:
        super().__init__()
        head_dim = d_model // num_heads
        if head_dim * num_heads != d_model:
            raise ValueError(f"d_model {d_model} is not a multiple of {num_heads} heads")
        self.qkv_proj = QKVLinear(d_model, head_dim, num_heads, num_heads, bias=True)
        self.out_proj = RowLinear(d_model, d_model, bias=True)
        self.attn = Attention(
            num_heads, head_dim, head_dim**-0.5, attn_type=attn_type, prefix=f"{prefix}.attn"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)  # 3 x [T, d_model]
        return self.out_proj(self.attn(q, k, v))


class CrossAttention(nn.Module):
    """Decoder queries over the encoder output: K/V are projected and written into the cross
    blocks on a request's first step only; later steps pass no encoder states and read them
    (or, absorbed, every step attends over the cached encoder output through kv_proj)."""

    def __init__(self, d_model: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        head_dim = d_model // num_heads
        self.q_proj = ColumnLinear(d_model, d_model, bias=True)
        self.kv_proj = MergedColumnLinear(d_model, [d_model, d_model], bias=True)
        self.out_proj = RowLinear(d_model, d_model, bias=True)
        self.attn = EncoderDecoderAttention(
            num_heads, head_dim, head_dim**-0.5, prefix=f"{prefix}.attn"
        )

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
    ) -> torch.Tensor:
        q = self.q_proj(hidden_states)  # [T, d_model]
        return self.out_proj(self.attn(q, self.kv_proj, encoder_hidden_states))
