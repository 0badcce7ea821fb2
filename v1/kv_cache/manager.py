"""`KVCacheManager`, the scheduler's one handle on the KV cache: per-request allocation across
all KV groups, all or nothing, through one per-type manager per group over one block pool.
It answers prefix-cache lookups, forks a held request's decoder blocks (copy-on-write of the
partial last block) and frees idempotently; `request.num_kv_slots` never exceeds what is held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from v1.kv_cache.block_hash import request_block_hashes
from v1.kv_cache.block_pool import BlockPool, KVCacheBlock
from v1.kv_cache.capacity import cdiv
from v1.kv_cache.single_type import (
    CrossAttentionManager,
    FullAttentionManager,
    get_manager_for_spec,
)
from v1.kv_cache.spec import KVCacheConfig

if TYPE_CHECKING:
    from v1.kv_cache.kv_request import KVRequest


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group, in `KVCacheConfig.groups` order."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        assert len(self.blocks) == len(other.blocks), "KVCacheBlocks of different configs"
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))

    @property
    def num_blocks(self) -> int:
        """Blocks over all groups."""
        return sum(len(group) for group in self.blocks)

    @staticmethod
    def empty(num_groups: int) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(num_groups)))


@dataclass(frozen=True)
class _Fork:
    parent_id: str
    move_last_block: bool


@dataclass(frozen=True)
class _Allocation:
    """What one allocate_slots / fork_slots call asks for."""

    num_new_tokens: int
    num_new_computed_tokens: int
    num_encoder_tokens: int
    fork: _Fork | None = None


class KVCacheManager:
    """Allocates the KV blocks of every group for each request from one shared pool."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # A config with no paged groups (encoder-only models) may have no blocks at all; the
        # pool still holds its null block.
        self.block_pool = BlockPool(max(kv_cache_config.num_blocks, 1), enable_caching)
        self.managers = tuple(
            get_manager_for_spec(group.spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_config.groups)
        )
        self._full_managers = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        self._full_tables = tuple((m.req_to_blocks, m.block_size) for m in self._full_managers)
        """(block tables, block size) of each full-attention group, for num_kv_slots."""
        self._encoder_entry_managers = [
            m for m in self.managers if isinstance(m, CrossAttentionManager)
        ]
        """Cross-attention and encoder-states groups: entries shared by encoder content hash."""
        full_block_sizes = {m.block_size for m in self._full_managers}
        if len(full_block_sizes) > 1:
            raise ValueError(
                f"full-attention groups must share one block size, got {sorted(full_block_sizes)}"
            )
        self.hash_block_size = full_block_sizes.pop() if full_block_sizes else 0
        """Block size of the chained hashes in request.block_hashes (0: no prefix caching)."""
        self.NO_NEW_BLOCKS = self._empty()
        """What allocate_slots returns when it added nothing (shared: never mutate it)."""
        self._deferred_caching: list[tuple[KVRequest, int]] = []
        """(request, tokens to cache) of tables grown by allocate_slots(defer_caching=True)
        whose filled blocks wait for cache_deferred_blocks."""
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Of those, tokens found cached."""
        self.cross_cache_lookups = 0
        """Cross-attention entries (per-layer K/V or absorbed encoder states) looked up by
        encoder content hash."""
        self.cross_cache_hits = 0
        """Of those, entries found cached (no new cross blocks, no projection written)."""
        self.num_forks = 0
        """Requests admitted on another request's decoder blocks (fork_slots)."""
        self.num_forked_tokens = 0
        """Tokens those forks took over instead of computing them."""
        self.num_block_copies = 0
        """Partial blocks copied by forks."""
        self._block_copies: dict[str, list[tuple[int, int]]] = {}
        """req_id -> (src, dst) block copies of its fork that no step carried yet."""

    # ---- stats ----
    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks in use."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out (the null block excluded)."""
        return self.block_pool.num_blocks - 1

    @property
    def num_requests(self) -> int:
        """Requests holding at least one block."""
        return len(
            {req_id for m in self.managers for req_id, blocks in m.req_to_blocks.items() if blocks}
        )

    def _empty(self) -> KVCacheBlocks:
        return KVCacheBlocks.empty(len(self.managers))

    # ---- prefix cache ----
    def get_computed_blocks(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hit blocks of a waiting request and how many tokens they cover.

        The hit never covers the whole prompt: the last token is always recomputed so that the
        step has logits to sample from. Does not take references; pass the result to
        `allocate_slots`, in the same step, before anything is freed.
        """
        self.cache_deferred_blocks()
        if not self.enable_caching or request.is_pooling or not self._full_managers:
            return self._empty(), 0
        request_block_hashes(request, self.hash_block_size)
        max_length = max(request.num_tokens - 1, 0)
        hits: dict[int, list[KVCacheBlock]] = {}
        for manager in self._full_managers:
            hit_blocks = manager.find_longest_cache_hit(request.block_hashes, max_length)
            hits[manager.group_id] = hit_blocks
            max_length = len(hit_blocks) * manager.block_size
        # Every full group must cover the same tokens: cut all to the shortest hit.
        num_hit_blocks = max_length // self.hash_block_size
        blocks = tuple(
            hits.get(group_id, [])[:num_hit_blocks] for group_id in range(len(self.managers))
        )
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += max_length
        return KVCacheBlocks(blocks), max_length

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (and nothing done) while any request holds blocks."""
        self.cache_deferred_blocks()
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ----
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_encoder_tokens: int = 0,
        defer_caching: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request`, all groups or none.

        Full-attention groups grow to cover num_computed_tokens + num_new_computed_tokens +
        num_new_tokens (capped at max_model_len); cross-attention and encoder-states groups
        attach to the entry of the request's encoder content hash when one exists, else get
        ceil(num_encoder_tokens / block_size) blocks if the request holds none yet.
        `new_computed_blocks` / `num_new_computed_tokens` come from `get_computed_blocks`.

        Returns the blocks added to the request's block tables by this call, per group and in
        table order (prefix hits first, then fresh blocks): the delta to send to the worker.
        Returns None, changing nothing, when the pool has too few free blocks.

        `defer_caching` (a step's running requests): blocks a grown table filled are registered
        in the prefix cache by `cache_deferred_blocks`, which the caller runs after its loop,
        so that the step's hashing runs together (any other call runs it first).
        """
        if not self.managers:
            # Encoder-only models: no paged layers, nothing to allocate (every admission asks).
            return self.NO_NEW_BLOCKS
        if new_computed_blocks is None and not num_encoder_tokens and self._full_managers:
            # The decode fast path (this runs for every running request each step): the full
            # tables already hold the slots (num_kv_slots: other kinds of groups never grow after
            # admission), or an admitted request's full tables grow.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens > self.max_model_len:
                num_tokens = self.max_model_len
            if num_tokens <= request.num_kv_slots:
                return self.NO_NEW_BLOCKS
            if (
                not num_new_computed_tokens
                and request.request_id in self._full_managers[0].req_to_blocks
            ):
                return self._grow(request, num_new_tokens, defer_caching)
        self.cache_deferred_blocks()
        if new_computed_blocks is None:
            new_computed_blocks = self._empty()
        assert len(new_computed_blocks.blocks) == len(self.managers), "blocks of another config"
        if self._full_managers:
            num_hit_blocks = len(new_computed_blocks.blocks[self._full_managers[0].group_id])
            assert num_new_computed_tokens == num_hit_blocks * self.hash_block_size, (
                "num_new_computed_tokens does not match new_computed_blocks"
            )
        return self._allocate(
            request,
            _Allocation(num_new_tokens, num_new_computed_tokens, num_encoder_tokens),
            new_computed_blocks,
        )

    def _grow(
        self, request: KVRequest, num_new_tokens: int, defer_caching: bool
    ) -> KVCacheBlocks | None:
        """`_allocate` for an admitted request (it holds a table in every group) without prefix
        hits, encoder tokens or a fork: only full-attention tables grow (cross-attention and
        encoder-states tables are allocated once, at admission). Filled blocks are registered
        in the prefix cache now, or with `defer_caching` by `cache_deferred_blocks`."""
        req_id = request.request_id
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_slots = num_tokens if num_tokens < self.max_model_len else self.max_model_len
        full = self._full_managers
        growth = [manager.num_blocks_to_grow(req_id, num_slots) for manager in full]
        if sum(growth) > self.block_pool.free_block_queue.num_free_blocks:
            return None
        added: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        for manager, num_blocks in zip(full, growth, strict=True):
            if num_blocks:
                added[manager.group_id] = manager.grow(req_id, num_blocks)
        if self.enable_caching and not request.is_pooling:
            # Cache only blocks whose tokens exist and will be computed by this step.
            num_tokens_to_cache = min(num_tokens, len(request.all_token_ids))
            self._deferred_caching.append((request, num_tokens_to_cache))
            if not defer_caching:
                self.cache_deferred_blocks()
        self._update_num_kv_slots(request)
        return KVCacheBlocks(tuple(added))

    def cache_deferred_blocks(self) -> None:
        """Registers the filled blocks of tables grown with `defer_caching` in the prefix cache,
        in the order they grew. Equivalent to registering each as it grew: in between, only
        other tables grew (taking free blocks, never these held ones), and every other call
        that reads or frees blocks runs this first."""
        deferred = self._deferred_caching
        if not deferred:
            return
        self._deferred_caching = []
        for request, _ in deferred:
            request_block_hashes(request, self.hash_block_size)
        for manager in self._full_managers:
            manager.cache_blocks_of(deferred)

    def fork_slots(
        self,
        request: KVRequest,
        parent: KVRequest,
        num_new_tokens: int,
        num_encoder_tokens: int = 0,
        move_last_block: bool = False,
    ) -> KVCacheBlocks | None:
        """Admits `request` on the decoder KV of `parent`, a finished request whose blocks are
        still held and whose computed tokens begin `request`'s, instead of computing them again.

        Per full-attention group the parent's full blocks are shared (ref counted) and its
        partial last block, which `request` will write into, is copied into a new block (the
        (src, dst) copy is queued for the runner: `take_block_copies`) or, with
        `move_last_block` (the parent is about to be freed and nothing else forks from it),
        handed over without a copy. Then, as `allocate_slots` with `parent.num_computed_tokens`
        computed tokens: cross-attention and encoder-states groups attach by encoder content
        hash, full-attention tables grow for `num_new_tokens`. Returns the request's new block
        tables, or None, changing nothing, when the pool has too few free blocks.
        """
        self.cache_deferred_blocks()
        req_id = request.request_id
        num_forked = parent.num_computed_tokens
        assert request.num_computed_tokens == 0 and not self.get_blocks(req_id).num_blocks
        assert self._full_managers and num_forked < request.num_tokens
        forked = KVCacheBlocks(
            tuple(
                list(m.get_blocks(parent.request_id)[: cdiv(num_forked, m.block_size)])
                if isinstance(m, FullAttentionManager)
                else []
                for m in self.managers
            )
        )
        # The parent's chained block hashes hold for the shared prefix (same tokens and
        # encoder input): the fork need not hash those blocks again.
        if not request.block_hashes:
            request.block_hashes = parent.block_hashes[: num_forked // self.hash_block_size]
        fork = _Fork(parent.request_id, move_last_block)
        allocation = _Allocation(num_new_tokens, num_forked, num_encoder_tokens, fork)
        blocks = self._allocate(request, allocation, forked)
        if blocks is not None and move_last_block:
            self._update_num_kv_slots(parent)  # its partial last block moved to `request`
        return blocks

    def _allocate(
        self, request: KVRequest, allocation: _Allocation, computed: KVCacheBlocks
    ) -> KVCacheBlocks | None:
        """allocate_slots and fork_slots past their checks: `computed` are prefix hits, or the
        parent's blocks of a fork."""
        req_id = request.request_id
        num_encoder_tokens = allocation.num_encoder_tokens
        fork = allocation.fork
        if self._encoder_entry_managers and num_encoder_tokens > 0:
            computed = self._attach_encoder_entries(request, computed, num_encoder_tokens)
        num_computed_tokens = request.num_computed_tokens + allocation.num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + allocation.num_new_tokens, self.max_model_len
        )
        num_blocks_to_allocate = sum(
            manager.get_num_blocks_to_allocate(
                req_id, num_tokens_need_slot, num_encoder_tokens, hit_blocks
            )
            for manager, hit_blocks in zip(self.managers, computed.blocks, strict=True)
        )
        copies_partial_block = (
            fork is not None
            and not fork.move_last_block
            and num_computed_tokens % self.hash_block_size != 0
        )
        if copies_partial_block:
            num_blocks_to_allocate += len(self._full_managers)  # one copy per full group
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        num_held = [len(manager.get_blocks(req_id)) for manager in self.managers]
        # Touch before allocating: a free hit must leave the free queue before any pop.
        for manager, hit_blocks in zip(self.managers, computed.blocks, strict=True):
            if fork is None or not isinstance(manager, FullAttentionManager):
                self.block_pool.touch(hit_blocks)
                manager.save_new_computed_blocks(req_id, hit_blocks)
        if fork is not None:
            self._fork_tables(req_id, fork, num_computed_tokens)
        for manager in self.managers:
            manager.allocate_new_blocks(req_id, num_tokens_need_slot, num_encoder_tokens)
        # The delta: hits (or the forked tables) then fresh blocks, in table order.
        added = tuple(
            list(manager.get_blocks(req_id)[held:])
            for manager, held in zip(self.managers, num_held, strict=True)
        )

        for manager in self._encoder_entry_managers:
            if request.encoder_hash is not None:
                manager.register(req_id, request.encoder_hash)
        if self.enable_caching and not request.is_pooling and self._full_managers:
            # Cache only blocks whose tokens exist and will be computed by this step.
            num_tokens_to_cache = min(
                num_computed_tokens + allocation.num_new_tokens, request.num_tokens
            )
            request_block_hashes(request, self.hash_block_size)
            for manager in self._full_managers:
                manager.cache_blocks(request, num_tokens_to_cache)
        self._update_num_kv_slots(request)
        return KVCacheBlocks(added)

    def _update_num_kv_slots(self, request: KVRequest) -> None:
        req_id = request.request_id
        num_slots = -1
        for req_to_blocks, block_size in self._full_tables:
            n = len(req_to_blocks[req_id]) * block_size
            if num_slots < 0 or n < num_slots:
                num_slots = n
        if num_slots >= 0:
            request.num_kv_slots = num_slots

    def _fork_tables(self, req_id: str, fork: _Fork, num_tokens: int) -> None:
        copies = [
            manager.fork(fork.parent_id, req_id, num_tokens, fork.move_last_block)
            for manager in self._full_managers
        ]
        copies = [c for c in copies if c is not None]
        if copies:
            self._block_copies.setdefault(req_id, []).extend(copies)
        self.num_forks += 1
        self.num_forked_tokens += num_tokens
        self.num_block_copies += len(copies)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued by forks since the last call, for the runner to
        perform before the step's forward (every src read before any dst is written)."""
        copies = [c for req_copies in self._block_copies.values() for c in req_copies]
        self._block_copies.clear()
        return copies

    def has_encoder_entry(self, request: KVRequest) -> bool:
        """Whether every cross-attention / encoder-states group already has an entry for the
        request's encoder input (held by another request, or freed and still cached), so that
        admitting it attaches to filled blocks: its encoder output need not be projected (or
        even computed) again. False for a request without encoder input or that holds blocks."""
        self.cache_deferred_blocks()
        content_hash = request.encoder_hash
        if content_hash is None or not self._encoder_entry_managers:
            return False
        return all(
            not manager.get_blocks(request.request_id)
            and manager.find_entry(content_hash, request.num_encoder_tokens)
            for manager in self._encoder_entry_managers
        )

    def _attach_encoder_entries(
        self, request: KVRequest, computed: KVCacheBlocks, num_encoder_tokens: int
    ) -> KVCacheBlocks:
        """`computed` plus, per cross-attention / encoder-states group the request holds nothing
        of yet, the blocks of an existing entry for its encoder content hash (taken like prefix
        hits)."""
        content_hash = request.encoder_hash
        if content_hash is None:
            return computed
        blocks = list(computed.blocks)
        for manager in self._encoder_entry_managers:
            if manager.get_blocks(request.request_id):
                continue
            found = manager.find_entry(content_hash, num_encoder_tokens)
            self.cross_cache_lookups += 1
            self.cross_cache_hits += bool(found)
            blocks[manager.group_id] = found
        return KVCacheBlocks(tuple(blocks))

    def cache_computed_blocks(self, request: KVRequest) -> None:
        """Registers the request's full blocks of known, computed tokens in the prefix cache
        (the decode fast path defers that registration)."""
        self.cache_deferred_blocks()
        if self.enable_caching and not request.is_pooling and self._full_managers:
            num_tokens = min(request.num_computed_tokens, request.num_tokens)
            if num_tokens >= self.hash_block_size and self._full_managers[0].get_blocks(
                request.request_id
            ):
                request_block_hashes(request, self.hash_block_size)
                for manager in self._full_managers:
                    manager.cache_blocks(request, num_tokens)

    def free(self, request: KVRequest) -> None:
        """Release every group's blocks of the request (finish, abort, preemption), and drop
        block copies of its fork that no step carried yet. Idempotent. Full blocks of known,
        computed tokens are registered in the prefix cache first."""
        if not self.managers:
            return  # encoder-only models: nothing allocated (every finish asks)
        self.cache_computed_blocks(request)
        self._block_copies.pop(request.request_id, None)
        for manager in self.managers:
            manager.free(request.request_id)
        request.num_kv_slots = 0

    # ---- lookups ----
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        self.cache_deferred_blocks()
        return KVCacheBlocks(tuple(list(m.get_blocks(request_id)) for m in self.managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's full block table per group."""
        if not self.managers:
            return ()  # encoder-only models (every admission asks)
        return self.get_blocks(request_id).get_block_ids()
