"""KV cache specs (what one attention layer needs per block) and the cache layout config.

Pure Python: the scheduler process builds its KVCacheManager from these without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
FP8_DTYPES = ("float8_e4m3fn",)
"""Cache dtypes stored with float32 scales: one per (token, head) for K and V, one per encoder
position for encoder states."""
SCALE_BYTES = 4


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer KV cache shape. Layers with equal specs form one group."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    """torch dtype name without the `torch.` prefix."""

    @property
    def has_scales(self) -> bool:
        """fp8 caches keep a float32 scale beside every row (see FP8_DTYPES)."""
        return self.dtype in FP8_DTYPES

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V rows, then their scales (fp8 only)."""
        row = self.num_kv_heads * self.head_size * _DTYPE_BYTES[self.dtype]
        if self.has_scales:
            row += self.num_kv_heads * SCALE_BYTES
        return 2 * self.block_size * row


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Decoder self-attention: grows a block every `block_size` tokens, prefix cacheable."""


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Cross-attention: ceil(num_encoder_tokens / block_size) blocks allocated once at admission,
    written on the first step, then read-only; never grows; one entry per encoder content hash,
    shared by its readers and cached (by that hash) once freed."""


@dataclass(frozen=True)
class EncoderStatesSpec(KVCacheSpec):
    """Absorbed cross-attention: the encoder output E [num_encoder_tokens, d_model] stored once
    per request and read by every decoder layer (one group with one pseudo-layer). Allocated at
    admission like cross-attention, never grows; requests with the same encoder content hash
    share the blocks. `num_kv_heads` is 1 and `head_size` is d_model: a block holds
    `block_size` encoder positions of `head_size` values (plus one scale each in fp8)."""

    page_size_padded: int | None = None
    """Pool page size when the encoder states share a pool with larger pages (the decoder's
    self-attention): a block uses its first `real_page_size_bytes`, the rest stays unused."""
    span: int = 1
    """Pool tensors one block spreads over. A block id of the pool owns one page in each of its
    tensors (one per layer of the largest group); the states, one pseudo-layer, fill the pages
    of the first `span` tensors (`block_size / span` positions each) instead of leaving all
    but the first unused."""

    @property
    def real_page_size_bytes(self) -> int:
        row = self.head_size * _DTYPE_BYTES[self.dtype]
        if self.has_scales:
            row += SCALE_BYTES
        return self.block_size // self.span * row

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.page_size_padded is None:
            return real
        assert self.page_size_padded >= real, (self.page_size_padded, real)
        return self.page_size_padded


def encoder_states_spec_in_pool(
    pool_spec: KVCacheSpec, d_model: int, span: int = 1
) -> EncoderStatesSpec:
    """The encoder-states spec that shares the pool of `pool_spec` (the decoder's
    self-attention, same dtype), with its page size, a block spread over `span` pool tensors
    (the self-attention layers: every tensor of the pool).

    A pool block of an attention layer is two halves (K and V) of `block_size * Hkv * D`
    values, and in fp8 two halves of `block_size * Hkv` scales after all the values. Encoder
    states use the same halves: `rows_per_half` positions of d_model values (and one scale each)
    in each, so a page holds `2 * rows_per_half` positions, a block `span` such pages, and no
    byte of it overlaps another block. Whisper large-v3 (32 decoder layers, 16-token blocks of
    20 x 64): 1,024 positions a block, so a request's 1500 take two block ids instead of 47."""
    half_values = pool_spec.block_size * pool_spec.num_kv_heads * pool_spec.head_size
    rows_per_half = half_values // d_model
    if pool_spec.has_scales:
        rows_per_half = min(rows_per_half, pool_spec.block_size * pool_spec.num_kv_heads)
    if rows_per_half < 1:
        raise ValueError(
            f"a KV block of {pool_spec.block_size} tokens x {pool_spec.num_kv_heads} heads x "
            f"{pool_spec.head_size} cannot hold one encoder position of {d_model} values: raise "
            "block_size or use cross_attention='per_layer'"
        )
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    return EncoderStatesSpec(
        block_size=span * 2 * rows_per_half,
        num_kv_heads=1,
        head_size=d_model,
        dtype=pool_spec.dtype,
        page_size_padded=pool_spec.page_size_bytes,
        span=span,
    )


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
