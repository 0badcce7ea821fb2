"""Per-KV-cache-group block managers: one block table per request for one attention type.

Full attention grows with the tokens and uses the prefix cache; cross-attention and encoder
states are allocated once at admission, shared by encoder content hash; encoder-only attention
holds nothing. All draw from one shared BlockPool; free is idempotent per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from v1.kv_cache.block_hash import encoder_states_block_hashes, iter_encoder_states_block_hashes
from v1.kv_cache.block_pool import BlockPool, KVCacheBlock
from v1.kv_cache.capacity import cdiv
from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheSpec,
)

if TYPE_CHECKING:
    from v1.kv_cache.kv_request import KVRequest


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group. Subclasses say how many blocks a request needs."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        """Block table of every request that holds (or held, until freed) this group's blocks."""

    def num_required_blocks(self, req_id: str, num_tokens: int, num_encoder_tokens: int) -> int:
        """Blocks the request's table must hold for `num_tokens` decoder tokens in total."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        num_encoder_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """Free blocks this allocation consumes: new blocks plus prefix hits that are now free
        (touching them takes them out of the free queue)."""
        num_held = len(self.req_to_blocks.get(req_id, ())) + len(new_computed_blocks)
        num_new = max(
            0, self.num_required_blocks(req_id, num_tokens, num_encoder_tokens) - num_held
        )
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Append already-touched prefix hits to the request's table."""
        if new_computed_blocks:
            assert not self.req_to_blocks.get(req_id), "prefix hits only for a fresh request"
            self.req_to_blocks.setdefault(req_id, []).extend(new_computed_blocks)

    def allocate_new_blocks(
        self, req_id: str, num_tokens: int, num_encoder_tokens: int
    ) -> list[KVCacheBlock]:
        """Grow the table to its required size; returns the blocks added."""
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_new = self.num_required_blocks(req_id, num_tokens, num_encoder_tokens) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` in the prefix cache."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Longest run of cached blocks covering at most `max_length` tokens."""
        return []

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first (prefix blocks evicted last). Idempotent."""
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Decoder self-attention: one block per `block_size` tokens, prefix cacheable."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.num_cached_blocks: dict[str, int] = {}
        """Leading blocks of each request already registered in the prefix cache."""

    def num_required_blocks(self, req_id: str, num_tokens: int, num_encoder_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        super().save_new_computed_blocks(req_id, new_computed_blocks)
        if new_computed_blocks:
            # Hits are cached already: they need no registering.
            self.num_cached_blocks[req_id] = len(new_computed_blocks)

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        req_id = request.request_id
        num_cached = self.num_cached_blocks.get(req_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id], request.block_hashes, num_cached, num_full, self.group_id
        )
        self.num_cached_blocks[req_id] = num_full

    def cache_blocks_of(self, pending: Sequence[tuple[KVRequest, int]]) -> None:
        """`cache_blocks` for a batch of (request, tokens to cache), in order (a step's
        decoding requests whose tables grew)."""
        for request, num_tokens in pending:
            self.cache_blocks(request, num_tokens)

    def num_blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Blocks the table of `req_id` (which holds one) lacks for `num_tokens` tokens."""
        num_new = -(-num_tokens // self.block_size) - len(self.req_to_blocks[req_id])  # cdiv
        return num_new if num_new > 0 else 0

    def grow(self, req_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """Appends `num_blocks` new blocks to the table of `req_id`; returns them."""
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[req_id].extend(new_blocks)
        return new_blocks

    def fork(
        self, parent_id: str, req_id: str, num_tokens: int, move_last_block: bool
    ) -> tuple[int, int] | None:
        """Gives `req_id` (holding nothing yet) the parent's blocks of its first `num_tokens`
        tokens: full blocks shared (ref counted); a partial last block copied into a new block
        or, with `move_last_block`, handed over (the parent's table drops it, so no two tables
        write into it). Returns the (src, dst) block ids of the copy, which the runner must
        perform before the request's first step, or None. The caller checked that the pool
        has the free block a copy takes."""
        parent = self.req_to_blocks[parent_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        assert len(parent) >= num_full + (partial > 0), "the parent holds too few blocks"
        shared = parent[:num_full]
        self.block_pool.touch(shared)  # held by the parent: none of them is free
        table = self.req_to_blocks[req_id] = list(shared)
        self.num_cached_blocks[req_id] = min(self.num_cached_blocks.get(parent_id, 0), num_full)
        if not partial:
            return None
        last = parent[num_full]
        if move_last_block:
            del parent[num_full]
            table.append(last)
            return None
        (copy,) = self.block_pool.get_new_blocks(1)
        table.append(copy)
        return last.block_id, copy.block_id

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self.num_cached_blocks.pop(req_id, None)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross-attention: ceil(num_encoder_tokens / block_size) blocks, allocated once when the
    request is admitted (or re-admitted after preemption), never grown. One entry per distinct
    encoder input: requests with the same content hash (n>1 children, beams, repeated audio or
    documents) hold the same blocks, ref-counted by the pool, so the encoder output is projected
    and stored once. With prefix caching on, a freed entry stays findable (the prefix cache of
    encoder-decoder models, keyed by encoder content) until its blocks are evicted. A request
    without encoder input holds none."""

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.live: dict[str, list[KVCacheBlock]] = {}
        """content hash -> the blocks of an entry some request holds."""
        self.num_holders: dict[str, int] = {}
        self.req_to_hash: dict[str, str] = {}

    def num_required_blocks(self, req_id: str, num_tokens: int, num_encoder_tokens: int) -> int:
        held = self.req_to_blocks.get(req_id)
        if held:
            # Allocated once: later calls (whatever num_encoder_tokens they pass) add nothing.
            return len(held)
        return cdiv(num_encoder_tokens, self.block_size)

    def find_entry(self, content_hash: str, num_encoder_tokens: int) -> list[KVCacheBlock]:
        """Blocks already holding this encoder input (a held entry, or a freed one not yet
        evicted), taking no reference; [] when there is none or a block was evicted."""
        blocks = self.live.get(content_hash)
        if blocks:
            return list(blocks)
        if not self.block_pool.enable_caching:
            return []
        hits = []
        num_blocks = cdiv(num_encoder_tokens, self.block_size)
        for key in iter_encoder_states_block_hashes(content_hash, num_blocks):
            block = self.block_pool.get_cached_block(key, self.group_id)
            if block is None:
                return []
            hits.append(block)
        return hits

    def register(self, req_id: str, content_hash: str) -> None:
        """Record that `req_id` holds the entry of `content_hash` (its blocks just allocated or
        attached) so later requests with the same content find it."""
        if req_id in self.req_to_hash:
            return
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        self.req_to_hash[req_id] = content_hash
        self.num_holders[content_hash] = self.num_holders.get(content_hash, 0) + 1
        self.live.setdefault(content_hash, blocks)
        keys = encoder_states_block_hashes(content_hash, len(blocks))
        self.block_pool.cache_full_blocks(blocks, keys, 0, len(blocks), self.group_id)

    def free(self, req_id: str) -> None:
        content_hash = self.req_to_hash.pop(req_id, None)
        if content_hash is not None:
            self.num_holders[content_hash] -= 1
            if self.num_holders[content_hash] == 0:
                del self.num_holders[content_hash]
                del self.live[content_hash]
        super().free(req_id)


class EncoderStatesManager(CrossAttentionManager):
    """Absorbed cross-attention's encoder states: the encoder output E itself, one entry per
    distinct encoder input, shared and cached exactly like per-layer cross-attention K/V."""


class EncoderOnlyAttentionManager(SingleTypeKVCacheManager):
    """Bidirectional attention without a cache: never holds a block."""

    def num_required_blocks(self, req_id: str, num_tokens: int, num_encoder_tokens: int) -> int:
        return 0


def get_manager_for_spec(
    spec: KVCacheSpec, block_pool: BlockPool, group_id: int
) -> SingleTypeKVCacheManager:
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return EncoderOnlyAttentionManager(spec, block_pool, group_id)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, group_id)
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager(spec, block_pool, group_id)
    if isinstance(spec, EncoderStatesSpec):
        return EncoderStatesManager(spec, block_pool, group_id)
    raise ValueError(f"no KV cache manager for spec {type(spec).__name__}")
