"""Attention backend interface: attention types, per-step metadata, bias descriptions.

A backend = static capabilities + a per-step MetadataBuilder (CommonAttentionMetadata -> the
backend's own metadata, built once per KV group / attention type and shared by its layers) +
an Impl whose forward writes K/V to the paged cache (where the type has one) and attends.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class AttentionType(str, enum.Enum):
    DECODER = "decoder"
    """Causal self-attention over the paged KV cache (decoder-only and decoder stacks)."""
    ENCODER = "encoder"
    """Bidirectional, no cache: the encoder of an encoder-decoder model."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional, no cache: encoder-only models (BERT)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over encoder K/V held in cross blocks (written once)."""

    @property
    def has_kv_cache(self) -> bool:
        return self in (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


@dataclass
class CommonAttentionMetadata:
    """One step's batch as seen by one attention type / KV group. Tensors are on the device
    unless named `*_cpu`. Requests are in batch order; tokens are packed (no padding)."""

    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: query token offsets."""
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    """[num_reqs] int32: key length per request after this step (DECODER: computed + scheduled;
    ENCODER_DECODER: encoder length; ENCODER/ENCODER_ONLY: the query length)."""
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool
    block_table: torch.Tensor | None = None
    """[num_reqs, max_num_blocks] int32 (paged types)."""
    slot_mapping: torch.Tensor | None = None
    """int64 slots of the K/V rows written this step (DECODER: one per query token;
    ENCODER_DECODER: one per encoder row being written; -1 skips a row)."""
    query_positions: torch.Tensor | None = None
    """[num_actual_tokens] int64 position of each query token in its sequence (bias needs it)."""


@dataclass
class MaterializedBias:
    """An additive bias given per step, padded per request: [num_reqs, num_heads, max_q, max_k]
    (row j of request r is its j-th query token of this step, column k its k-th key)."""

    bias: torch.Tensor


@dataclass
class RelativePositionBias:
    """T5 bucketed relative positions: bias[h, q, k] = table[bucket(k_pos - q_pos), h].

    Kernels evaluate it on the fly; the SDPA backend expands it."""

    table: torch.Tensor
    """[num_buckets, num_heads] learned per-head table."""
    num_buckets: int
    max_distance: int
    bidirectional: bool


AttentionBias = MaterializedBias | RelativePositionBias


class AttentionMetadataBuilder(ABC):
    def __init__(self, attn_type: AttentionType, device: torch.device, block_size: int = 0) -> None:
        self.attn_type = attn_type
        self.device = device
        self.block_size = block_size
        """Tokens per KV block (paged types)."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any: ...


class AttentionImpl(ABC):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        attn_type: AttentionType,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.attn_type = attn_type

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        bias: AttentionBias | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H, D]; key/value [T', Hkv, D] or None (cross-attention steps that write
        nothing); kv_cache [2, num_blocks, block_size, Hkv, D] or empty; kv_scales [2,
        num_blocks, block_size, Hkv] float32 when the cache is fp8 (rows are stored quantized
        per head and dequantized inside attention). Returns [T, H, D]."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Write K/V rows to the cache at the metadata's slot mapping, attending nothing."""
        from v1.attention.ops.reference import write_kv_cache

        write_kv_cache(key, value, kv_cache, attn_metadata.common.slot_mapping, kv_scales)


class AttentionBackend(ABC):
    name: ClassVar[str]
    supported_attn_types: ClassVar[frozenset[AttentionType]]
    supports_bias: ClassVar[bool] = False
    supports_fp8_kv_cache: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
