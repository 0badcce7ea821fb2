"""flash-attn backend (GPU, when the `flash-attn` package is installed).

Varlen kernels for all four types; paged types read the cache through the block table
(flash-attn 2 needs block_size % 256 == 0 for that, checked at start-up). No additive bias:
models with T5 relative positions use the Triton backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func

from v1.attention.backend import (
    AttentionBackend,
    AttentionBias,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendCapabilities,
    CommonAttentionMetadata,
)
from v1.attention.ops.triton_attention import write_kv_cache

PAGE_MULTIPLE = 256


@dataclass
class FlashAttnMetadata:
    common: CommonAttentionMetadata
    cu_seqlens_k: torch.Tensor


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        if self.attn_type.has_kv_cache and self.block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"the flash_attn backend needs block_size % {PAGE_MULTIPLE} == 0, got "
                f"{self.block_size}"
            )
        cu_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(common.seq_lens[: common.num_reqs], 0, out=cu_k[1:])
        return FlashAttnMetadata(common, cu_k)


class FlashAttnImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttnMetadata,
        bias: AttentionBias | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if bias is not None:
            raise ValueError("the flash_attn backend has no additive bias; use triton")
        if kv_scales is not None:
            raise ValueError("the flash_attn backend has no fp8 KV cache; use triton")
        common = attn_metadata.common
        num_tokens = common.num_actual_tokens
        out = torch.zeros_like(query)
        if self.attn_type.has_kv_cache:
            if key is not None and common.slot_mapping is not None:
                write_kv_cache(key, value, kv_cache, common.slot_mapping)
            out[:num_tokens] = flash_attn_varlen_func(
                query[:num_tokens],
                kv_cache[0],
                kv_cache[1],
                cu_seqlens_q=common.query_start_loc,
                cu_seqlens_k=attn_metadata.cu_seqlens_k,
                max_seqlen_q=common.max_query_len,
                max_seqlen_k=common.max_seq_len,
                softmax_scale=self.scale,
                causal=common.causal,
                block_table=common.block_table,
            )
        else:
            out[:num_tokens] = flash_attn_varlen_func(
                query[:num_tokens],
                key[:num_tokens],
                value[:num_tokens],
                cu_seqlens_q=common.query_start_loc,
                cu_seqlens_k=common.query_start_loc,
                max_seqlen_q=common.max_query_len,
                max_seqlen_k=common.max_query_len,
                softmax_scale=self.scale,
                causal=common.causal,
            )
        return out


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    capabilities = BackendCapabilities(
        device_types=frozenset({"cuda"}),
        min_compute_capability=(8, 0),
        block_size_multiple=PAGE_MULTIPLE,
        required_packages=("flash_attn", "triton"),
    )

    @classmethod
    def get_encoder_states_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The absorbed kernels read the Triton backend's work items."""
        from v1.attention.backends.triton import TritonBackend

        return TritonBackend.get_builder_cls()

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl
