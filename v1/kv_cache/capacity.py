"""How many KV blocks one request needs, per the cache layout (pure Python).

Used by the engine's start-up check (one maximal request must fit the pool) and by admission
(a request that could never fit is rejected instead of waiting forever).
"""

from __future__ import annotations

from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheConfig,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks_needed(
    kv_cache_config: KVCacheConfig, num_tokens: int, num_encoder_tokens: int = 0
) -> int:
    """Blocks over all groups for `num_tokens` decoder tokens and `num_encoder_tokens` encoder
    positions (cross-attention and encoder-states groups), with no prefix-cache hits."""
    total = 0
    for group in kv_cache_config.groups:
        spec = group.spec
        if isinstance(spec, FullAttentionSpec):
            total += cdiv(num_tokens, spec.block_size)
        elif isinstance(spec, (CrossAttentionSpec, EncoderStatesSpec)):
            total += cdiv(num_encoder_tokens, spec.block_size)
    return total


def num_usable_blocks(kv_cache_config: KVCacheConfig) -> int:
    """Blocks a request can be given: the pool without its null block."""
    return max(kv_cache_config.num_blocks - 1, 0)


def max_tokens_that_fit(kv_cache_config: KVCacheConfig, num_encoder_tokens: int = 0) -> int:
    """The longest decoder sequence one request can hold alone beside `num_encoder_tokens`
    cross-attention positions (0 when not even those fit)."""
    free = num_usable_blocks(kv_cache_config) - num_blocks_needed(
        kv_cache_config, 0, num_encoder_tokens
    )
    full = [g.spec for g in kv_cache_config.groups if isinstance(g.spec, FullAttentionSpec)]
    if not full:
        return 1 << 62  # no decoder self-attention blocks: the cache does not bound its length
    if free <= 0:
        return 0
    # Each full group takes one block per block_size tokens (equal block sizes in practice).
    return (free // len(full)) * min(spec.block_size for spec in full)
