"""The Attention layer models use: reads its step metadata from the forward context by name.

The runner binds `kv_cache` (a [2, num_blocks, block_size, Hkv, D] view) to every paged layer
after allocating the cache; cache-less types keep an empty tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from v1.attention.backend import AttentionBias, AttentionType
from v1.attention.selector import get_attn_backend
from v1.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not prefix:
            raise ValueError("Attention needs a unique prefix (its layer name)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.scale = scale
        self.attn_type = attn_type
        self.layer_name = prefix
        self.backend = get_attn_backend()
        if attn_type not in self.backend.capabilities.attn_types:
            raise ValueError(f"{self.backend.name} does not support {attn_type.value} attention")
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, self.num_kv_heads, attn_type
        )
        self.kv_cache = torch.empty(0)
        self.kv_scales: torch.Tensor | None = None
        """[2, num_blocks, block_size, Hkv] float32 scales of an fp8 `kv_cache` (else None)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        bias: AttentionBias | None = None,
    ) -> torch.Tensor:
        """query [T, H*D]; key/value [T', Hkv*D] (None for a cross layer with nothing to
        write this step). Returns [T, H*D]."""
        context = get_forward_context()
        num_tokens = query.shape[0]
        if context.profiling:
            # Memory profiling runs the model before the KV cache exists: skip attention.
            return torch.zeros_like(query)
        if context.cross_kv_only:
            if self.attn_type == AttentionType.ENCODER_DECODER and key is not None:
                metadata = context.attn_metadata[self.layer_name]
                k = key.view(-1, self.num_kv_heads, self.head_size)
                v = value.view(-1, self.num_kv_heads, self.head_size)
                # fp8 caches pass their scales (impls without fp8 support never get them).
                extra = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}
                self.impl.write_kv(k, v, self.kv_cache, metadata, **extra)
            return torch.zeros_like(query)
        metadata = context.attn_metadata[self.layer_name]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size) if key is not None else None
        v = value.view(-1, self.num_kv_heads, self.head_size) if value is not None else None
        extra = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}
        out = self.impl.forward(q, k, v, self.kv_cache, metadata, bias, **extra)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}, type={self.attn_type.value}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}, head_size={self.head_size}, backend={self.backend.name}"
        )
