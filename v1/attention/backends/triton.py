"""Triton backend (GPU): one paged varlen kernel for all four attention types, bias in-kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.attention.backend import (
    AttentionBackend,
    AttentionBias,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MaterializedBias,
    RelativePositionBias,
)
from v1.attention.ops import triton_attention as ops

BLOCK_M = 64
DECODE_BLOCK_M = 16


@dataclass
class TritonMetadata:
    common: CommonAttentionMetadata
    work: tuple[torch.Tensor, torch.Tensor]
    """(request, query block) per program."""
    block_m: int


class TritonMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        block_m = DECODE_BLOCK_M if common.max_query_len <= DECODE_BLOCK_M else BLOCK_M
        work = ops.make_work_items(common.query_start_loc_cpu[: common.num_reqs + 1], block_m, self.device)
        return TritonMetadata(common, work, block_m)


class TritonImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
        bias: AttentionBias | None = None,
    ) -> torch.Tensor:
        common = attn_metadata.common
        paged = self.attn_type.has_kv_cache
        if paged and key is not None and common.slot_mapping is not None:
            ops.write_kv_cache(key, value, kv_cache, common.slot_mapping)
        if paged:
            k = kv_cache[0].flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
            v = kv_cache[1].flatten(0, 1)
            page = kv_cache.shape[2]
        else:
            k, v, page = key, value, 1
        out = torch.empty_like(query)
        bias_tensor, bias_mode, relative = None, ops.BIAS_NONE, (32, 128, True)
        if isinstance(bias, MaterializedBias):
            bias_tensor, bias_mode = bias.bias, ops.BIAS_MATERIALIZED
        elif isinstance(bias, RelativePositionBias):
            bias_tensor, bias_mode = bias.table, ops.BIAS_RELATIVE
            relative = (bias.num_buckets, bias.max_distance, bias.bidirectional)
        return ops.paged_attention(
            query,
            k,
            v,
            out,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            work=attn_metadata.work,
            query_positions=common.query_positions,
            scale=self.scale,
            causal=common.causal,
            block_table=common.block_table if paged else None,
            page_size=page,
            bias=bias_tensor,
            bias_mode=bias_mode,
            relative=relative,
            block_m=attn_metadata.block_m,
        )


class TritonBackend(AttentionBackend):
    name = "triton"
    supported_attn_types = frozenset(AttentionType)
    supports_bias = True

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl
