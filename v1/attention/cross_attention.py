"""The cross-attention layer of encoder-decoder decoders, in the mode the config resolved.

per_layer: each layer writes its K/V of the encoder output to cross blocks on a request's first
step and reads them after. absorbed: the encoder output E is cached once (ENCODER_STATES_LAYER)
and every layer attends over it through its query projected by W_k; the K/V never exist.
"""

from __future__ import annotations

import torch

from v1.attention.backend import AttentionType
from v1.attention.layer import Attention
from v1.attention.ops.absorbed_cross_attention import (
    CrossProjection,
    absorb_query,
    absorbed_cross_attention,
    project_values,
)
from v1.forward_context import get_forward_context

ENCODER_STATES_LAYER = "encoder_states"
"""The one pseudo-layer of the encoder-states KV group; absorbed layers read its metadata."""


class EncoderDecoderAttention(Attention):
    def __init__(self, num_heads: int, head_size: int, scale: float, prefix: str) -> None:
        super().__init__(
            num_heads, head_size, scale, attn_type=AttentionType.ENCODER_DECODER, prefix=prefix
        )
        self.absorbed = False
        """Set by the runner when cross_attention is absorbed (the cache views below follow
        once the cache exists)."""
        self.encoder_states = torch.empty(0)
        """[2, num_blocks, rows_per_half, d]: the encoder-states cache all layers share."""
        self.encoder_states_scales: torch.Tensor | None = None
        """[2, num_blocks, rows_per_half] float32 (fp8 caches only)."""

    def bind_encoder_states(self, states: torch.Tensor, scales: torch.Tensor | None) -> None:
        assert self.absorbed, "encoder states are bound to absorbed layers only"
        self.encoder_states = states
        self.encoder_states_scales = scales

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_proj: torch.nn.Module,
        encoder_hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        """query [T, H*D]; `kv_proj` the layer's fused k/v projection [2*Hkv*D, d];
        encoder_hidden_states [Tw, d] of the requests whose cross K/V this step writes (per_layer
        only; None when nothing is written). Returns [T, H*D]."""
        if not self.absorbed:
            key = value = None
            if encoder_hidden_states is not None:
                key, value = kv_proj(encoder_hidden_states).chunk(2, dim=-1)  # [Tw, Hkv*D]
            return super().forward(query, key, value)
        context = get_forward_context()
        proj = CrossProjection.of(kv_proj, self.head_size)
        if context.cross_kv_only:
            return torch.zeros_like(query)  # the runner's pre-step writes E itself
        if context.profiling:
            # No cache yet; the [T, H, d] query and context are this mode's big activations,
            # so the memory profile allocates them.
            q_abs = absorb_query(query, proj, self.num_heads, self.scale)
            return project_values(torch.zeros_like(q_abs), proj)
        return absorbed_cross_attention(
            query,
            proj,
            self.encoder_states,
            self.encoder_states_scales,
            context.attn_metadata[ENCODER_STATES_LAYER],
            self.num_heads,
            self.scale,
        )
