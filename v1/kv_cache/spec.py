"""KV cache specs (what one attention layer needs per block) and the cache layout config.

Pure Python: the scheduler process builds its KVCacheManager from these without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer KV cache shape. Layers with equal specs form one group."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    """torch dtype name without the `torch.` prefix."""

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Decoder self-attention: grows a block every `block_size` tokens, prefix cacheable."""


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Cross-attention: ceil(num_encoder_tokens / block_size) blocks allocated once at admission,
    written on the first step, then read-only; never grows, never prefix-cached."""


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(KVCacheSpec):
    """Bidirectional attention with no cache (encoders, encoder-only models): no blocks at all."""

    @property
    def page_size_bytes(self) -> int:
        return 0


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec, and so one block table per request."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One device tensor of `num_blocks` blocks; the j-th layer of every group uses tensor j
    (block ids never collide across groups because they come from one pool)."""

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    """Blocks in the one pool, the null block 0 included."""
    groups: tuple[KVCacheGroupSpec, ...]
    """Paged groups only (encoder-only layers have none); order = block_ids tuple order."""
    tensors: tuple[KVCacheTensor, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size if self.groups else 0
