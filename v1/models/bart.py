"""BART, mBART and Marian: one encoder-decoder transformer with three flavours.

BART: post-norm layers, learned positions offset by 2, a LayerNorm on the embeddings. mBART: the
same with pre-norm layers and a final LayerNorm after each stack. Marian: post-norm, fixed
sinusoidal positions, no embedding LayerNorm, and (optionally) its own decoder vocabulary.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from v1.attention.backend import AttentionType
from v1.attention.layer import Attention
from v1.models.layers.activation import get_act_fn
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear
from v1.models.layers.norm import LayerNorm
from v1.models.utils import load_weights_into

# Checkpoint projections are renamed onto fused parameters before the packed mapping applies:
# the same names (q_proj, k_proj, v_proj) go to different fused layers in self- and
# cross-attention, and `packed_modules_mapping` keys on one name component only.
_SELF_QKV = re.compile(r"\.self_attn\.([qkv])_proj\.")
_CROSS_KV = re.compile(r"\.encoder_attn\.([kv])_proj\.")
_LEARNED_POS_OFFSET = 2
"""BART and mBART learned position i sits in row i + 2 (fairseq's padding offset)."""


@dataclass(frozen=True)
class BartVariant:
    """How the three flavours differ."""

    pre_norm: bool
    """LayerNorm before each sub-block (mBART) instead of after the residual add."""
    learned_positions: bool
    """Learned positions with the +2 offset (BART, mBART); else sinusoidal (Marian)."""
    layernorm_embedding: bool
    """LayerNorm on token + position embeddings (BART, mBART)."""
    final_layer_norm: bool
    """LayerNorm after the last layer of each stack (mBART)."""


BART = BartVariant(pre_norm=False, learned_positions=True, layernorm_embedding=True, final_layer_norm=False)
MBART = BartVariant(pre_norm=True, learned_positions=True, layernorm_embedding=True, final_layer_norm=True)
MARIAN = BartVariant(
    pre_norm=False, learned_positions=False, layernorm_embedding=False, final_layer_norm=False
)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """transformers' MarianSinusoidalPositionalEmbedding weight [num_positions, dim] in float32:
    sin features in the first half, cos in the second (not interleaved), computed in float64
    with numpy exactly as there."""
    j = np.arange(dim)
    position_enc = np.arange(num_positions)[:, None] / np.power(10000, 2 * (j // 2) / dim)[None, :]
    out = np.empty((num_positions, dim), dtype=np.float32)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, :sentinel] = np.sin(position_enc[:, 0::2])
    out[:, sentinel:] = np.cos(position_enc[:, 1::2])
    return torch.from_numpy(out)


class BartSelfAttention(nn.Module):
    """Bidirectional (encoder) or causal paged (decoder) self-attention, fused q/k/v."""

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


class BartCrossAttention(nn.Module):
    """Decoder queries over the encoder output: K/V are projected and written to the cross
    blocks only on a request's first step; later steps pass no encoder states and read them."""

    def __init__(self, d_model: int, num_heads: int, prefix: str) -> None:
        super().__init__()
        head_dim = d_model // num_heads
        self.q_proj = ColumnLinear(d_model, d_model, bias=True)
        self.kv_proj = MergedColumnLinear(d_model, [d_model, d_model], bias=True)
        self.out_proj = RowLinear(d_model, d_model, bias=True)
        self.attn = Attention(
            num_heads,
            head_dim,
            head_dim**-0.5,
            attn_type=AttentionType.ENCODER_DECODER,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
    ) -> torch.Tensor:
        q = self.q_proj(hidden_states)  # [T, d_model]
        k = v = None
        if encoder_hidden_states is not None:
            k, v = self.kv_proj(encoder_hidden_states).chunk(2, dim=-1)  # 2 x [Tw, d_model]
        return self.out_proj(self.attn(q, k, v))


def _sublayer(
    norm: LayerNorm, pre_norm: bool, hidden_states: torch.Tensor, block: Any, *args: Any
) -> torch.Tensor:
    """Residual sub-block: pre-norm x + f(norm(x)) or post-norm norm(x + f(x))."""
    if pre_norm:
        return hidden_states + block(norm(hidden_states), *args)
    return norm(hidden_states + block(hidden_states, *args))


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers clamps fp16 encoder outputs to avoid inf (BART/Marian only once non-finite:
    # we clamp always, which differs only for finite values within 1000 of the fp16 max, and
    # needs no host sync).
    if hidden_states.dtype != torch.float16:
        return hidden_states
    limit = torch.finfo(torch.float16).max - 1000
    return hidden_states.clamp(-limit, limit)


