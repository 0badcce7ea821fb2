"""torch SDPA backend: all four attention types over the paged cache, on any device.

It is the reference every other backend is tested against. The batch is padded to
[num_reqs, heads, max_q, max_k] with index tensors built once per step by the builder, so no
Python loop runs over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v1.attention.backend import (
    AttentionBackend,
    AttentionBias,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendCapabilities,
    CommonAttentionMetadata,
    MaterializedBias,
    RelativePositionBias,
)
from v1.attention.ops.reference import read_kv_rows, write_kv_cache


@dataclass
class SDPAMetadata:
    common: CommonAttentionMetadata
    token_req: torch.Tensor
    """[T] request index of each packed query token."""
    token_local: torch.Tensor
    """[T] index of each query token within its request's query."""
    mask: torch.Tensor
    """[R, 1, max_q, max_k] bool: True where a query may attend a key."""
    key_gather: torch.Tensor | None
    """[R, max_k] flat cache slot of each key (paged types)."""
    key_req: torch.Tensor | None
    key_local: torch.Tensor | None
    """Packed-key indices for the cache-less types (keys are the query tokens)."""
    query_pos: torch.Tensor
    """[R, max_q] position of each padded query in its sequence."""


class SDPAMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        device = common.query_start_loc.device
        num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
        qsl = common.query_start_loc[: num_reqs + 1].long()
        query_lens = qsl[1:] - qsl[:-1]
        seq_lens = common.seq_lens[:num_reqs].long()
        max_q, max_k = max(common.max_query_len, 1), max(common.max_seq_len, 1)

        token_req = torch.repeat_interleave(
            torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens
        )
        token_local = torch.arange(num_tokens, device=device) - qsl[token_req]
        # Query j of request r sits at position seq_len - query_len + j.
        q_idx = torch.arange(max_q, device=device)
        k_idx = torch.arange(max_k, device=device)
        query_pos = (seq_lens - query_lens)[:, None] + q_idx[None, :]  # [R, max_q]
        mask = k_idx[None, None, :] < seq_lens[:, None, None]  # [R, 1, max_k]
        if common.causal:
            mask = mask & (k_idx[None, None, :] <= query_pos[:, :, None])  # [R, max_q, max_k]
        mask = mask.expand(num_reqs, max_q, max_k).clone()
        # Padded query rows would see no key (NaN softmax): let them see key 0, then drop them.
        mask[:, :, 0] |= q_idx[None, :] >= query_lens[:, None]
        if common.query_positions is not None:
            # Bias reads the true positions: a cross-attention query sits at its decoder
            # position, not at encoder_len - query_len + j.
            query_pos[token_req, token_local] = common.query_positions[:num_tokens].long()
        key_gather = key_req = key_local = None
        if common.block_table is not None:
            bt = common.block_table[:num_reqs].long()
            block_size = self.block_size
            blk = bt.gather(
                1, (k_idx // block_size).clamp(max=bt.shape[1] - 1)[None].expand(num_reqs, -1)
            )
            key_gather = blk * block_size + (k_idx % block_size)[None, :]
        else:
            key_req, key_local = token_req, token_local
        return SDPAMetadata(
            common, token_req, token_local, mask[:, None], key_gather, key_req, key_local, query_pos
        )


def relative_bias(bias: RelativePositionBias, query_pos: torch.Tensor, max_k: int) -> torch.Tensor:
    """Expand a T5 relative-position description to [R, H, max_q, max_k]."""
    from v1.attention.ops.t5_bias import relative_position_bucket

    k_pos = torch.arange(max_k, device=query_pos.device)
    rel = k_pos[None, None, :] - query_pos[:, :, None]  # [R, max_q, max_k]
    buckets = relative_position_bucket(rel, bias.bidirectional, bias.num_buckets, bias.max_distance)
    return bias.table[buckets].permute(0, 3, 1, 2)  # [R, H, max_q, max_k]


class SDPAImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: SDPAMetadata,
        bias: AttentionBias | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md, common = attn_metadata, attn_metadata.common
        num_tokens = common.num_actual_tokens
        num_reqs = common.num_reqs
        max_q, max_k = md.mask.shape[2], md.mask.shape[3]
        paged = self.attn_type.has_kv_cache
        if paged and key is not None and common.slot_mapping is not None:
            write_kv_cache(key, value, kv_cache, common.slot_mapping, kv_scales)

        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_size
        q = query.new_zeros(num_reqs, max_q, heads, dim)
        q[md.token_req, md.token_local] = query[:num_tokens]
        if paged:  # fp8 caches dequantize here
            k = read_kv_rows(
                kv_cache, kv_scales, 0, md.key_gather, query.dtype
            )  # [R, max_k, Hkv, D]
            v = read_kv_rows(kv_cache, kv_scales, 1, md.key_gather, query.dtype)
        else:
            k = key.new_zeros(num_reqs, max_k, kv_heads, dim)
            v = value.new_zeros(num_reqs, max_k, kv_heads, dim)
            k[md.key_req, md.key_local] = key[:num_tokens]
            v[md.key_req, md.key_local] = value[:num_tokens]

        mask = md.mask
        if bias is not None:
            if isinstance(bias, RelativePositionBias):
                extra = relative_bias(bias, md.query_pos, max_k)
            else:
                extra = bias.bias
            float_mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            float_mask = float_mask.masked_fill(~mask, float("-inf"))
            mask = float_mask + extra.to(query.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).to(q.dtype),
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=heads != kv_heads,
        )  # [R, H, max_q, D]
        out = out.transpose(1, 2)[md.token_req, md.token_local]  # [num_actual_tokens, H, D]
        if query.shape[0] > num_tokens:  # padded batch: pad rows come back as zeros
            out = torch.cat([out, out.new_zeros(query.shape[0] - num_tokens, heads, dim)])
        return out  # [T, H, D]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    capabilities = BackendCapabilities(materialized_bias=True, fp8_kv_cache=True)

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return SDPAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return SDPAImpl


__all__ = [
    "TorchSDPABackend",
    "SDPAImpl",
    "SDPAMetadata",
    "SDPAMetadataBuilder",
    "MaterializedBias",
]
