"""KV cache management for the EngineCore: specs, the block pool, per-type managers, sizing.

Pure Python (no torch): the scheduler process uses it without touching a device.
"""

from v1.kv_cache.block_hash import hash_block_tokens, request_block_hashes
from v1.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from v1.kv_cache.manager import KVCacheBlocks, KVCacheManager
from v1.kv_cache.single_type import (
    CrossAttentionManager,
    EncoderOnlyAttentionManager,
    EncoderStatesManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from v1.kv_cache.sizing import get_kv_cache_config
from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)

__all__ = [
    "BlockPool",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionManager",
    "EncoderOnlyAttentionSpec",
    "EncoderStatesManager",
    "EncoderStatesSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "SingleTypeKVCacheManager",
    "get_kv_cache_config",
    "hash_block_tokens",
    "request_block_hashes",
]
