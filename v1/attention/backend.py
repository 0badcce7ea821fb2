"""Attention backend interface: attention types, static capabilities, per-step metadata, bias.

A backend = `BackendCapabilities` (what the selector filters on; code outside v1/attention asks
these, never a backend's name) + a MetadataBuilder (CommonAttentionMetadata -> the backend's
metadata, once per KV group) + an Impl that writes K/V to the paged cache and attends.
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


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend serves, declared on its class; `v1/attention/selector.py` matches these
    against what the model and device need."""

    attn_types: frozenset[AttentionType] = frozenset(AttentionType)
    """Attention types (KV groups) it builds metadata for and runs."""
    encoder_states: bool = True
    """Builds the metadata of the absorbed encoder-states group (cross_attention=absorbed)."""
    materialized_bias: bool = False
    """Takes a `MaterializedBias`, in prefill and decode steps."""
    in_kernel_bias: bool = False
    """Evaluates a `RelativePositionBias` inside the kernel, in prefill and decode steps (a
    backend with materialized_bias only expands it: T5 is served either way)."""
    fp8_kv_cache: bool = False
    """Reads and writes fp8 KV caches (with their float32 scales)."""
    fp8_min_compute_capability: tuple[int, int] | None = None
    """On CUDA, the compute capability its fp8 path needs (None: any)."""
    device_types: frozenset[str] = frozenset({"cpu", "cuda"})
    min_compute_capability: tuple[int, int] | None = None
    """On CUDA, the least compute capability it runs on (None: any)."""
    block_size_multiple: int = 1
    """KV block sizes it pages over must be multiples of this."""
    decode_cuda_graphs: bool = False
    """Decoder steps replay in CUDA graphs: its builder gives the static work of
    `AttentionMetadataBuilder.graph_work` for queries up to `graph_max_query_len` tokens."""
    graph_max_query_len: int = 0
    """Longest query a decoder-step graph serves (one work item per request)."""
    encoder_cuda_graphs: bool = False
    """Encoder-only forwards replay in CUDA graphs (16-bit models; v1/worker/encoder_graphs.py)."""
    required_packages: tuple[str, ...] = ()
    """Python packages it imports (a backend whose package is missing is skipped)."""

    @property
    def bias(self) -> bool:
        """Serves models with an additive attention bias (T5 relative positions)."""
        return self.materialized_bias or self.in_kernel_bias


class AttentionMetadataBuilder(ABC):
    def __init__(self, attn_type: AttentionType, device: torch.device, block_size: int = 0) -> None:
        self.attn_type = attn_type
        self.device = device
        self.block_size = block_size
        """Tokens per KV block (paged types)."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any: ...

    def graph_work(self, metadata: Any) -> tuple[int, int] | None:
        """(work items, query rows per item) of metadata built for a CUDA graph, which replays
        reuse; None where the backend has no static work (no decoder-step graphs)."""
        return None


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
    capabilities: ClassVar[BackendCapabilities]

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @classmethod
    def get_encoder_states_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """Builder of the absorbed encoder-states group's metadata (default: its own)."""
        return cls.get_builder_cls()

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def power_of_two_parts(n: int) -> list[int]:
    """n as descending powers of two (25 -> [16, 8, 1]): batch parts of a kernel that builds
    a plan per batch size (cuDNN's dense attention), so few sizes are ever built."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]
