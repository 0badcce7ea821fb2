"""The one pool of KV cache blocks shared by every KV cache group.

Owns block ref counts, the LRU free queue and the prefix-cache map (block hash -> cached block).
A freed block keeps its hash and stays reusable until it is popped for a new allocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One block of the pool; `ref_cnt` counts the requests whose block table holds it."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        """Set while the block is registered in the prefix cache (full and hashed)."""
        self.group_id = -1
        """The KV cache group whose prefix cache holds the block (valid with block_hash)."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        hash_hex = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks with O(1) popleft, remove and append.

    LRU order: freed blocks are appended at the tail, allocation takes from the head, so the block
    freed longest ago (and, within one request, the tail block freed first) is evicted first.
    Two sentinel blocks (id -1) bound the list so no operation special-cases the ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        # n times popleft, unlinking the first n blocks at once.
        head = self._head
        blocks = []
        block = head.next_free_block
        for _ in range(n):
            assert block is not None and block is not self._tail
            blocks.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks from head (next evicted) to tail."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """All `num_blocks` blocks; block 0 is the null block and is never handed out.

    The prefix cache maps (group_id, block_hash) to the blocks holding that content. Cached
    blocks stay in the map while free and are evicted lazily, when popped for a new allocation.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least the null block, got {num_blocks=}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Several blocks can hold the same content (two requests computed it at once), so a
        # key maps to {block_id: block}; lookups return any one of them.
        self.cached_block_hash_to_block: dict[tuple[int, bytes], dict[int, KVCacheBlock]] = {}

    # ---- prefix cache ----
    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get((group_id, block_hash))
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under block_hashes[i].

        blocks[:num_cached_blocks] are already registered (or were cache hits).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, "block hashes lag behind full blocks"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                # Already registered (a prefix hit shared with another request).
                assert block.block_hash == block_hashes[i] and block.group_id == group_id
                continue
            block.block_hash = block_hashes[i]
            block.group_id = group_id
            key = (group_id, block.block_hash)
            self.cached_block_hash_to_block.setdefault(key, {})[block.block_id] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        key = (block.group_id, block.block_hash)
        blocks = self.cached_block_hash_to_block.get(key)
        if blocks is not None:
            blocks.pop(block.block_id, None)
            if not blocks:
                del self.cached_block_hash_to_block[key]
        block.block_hash = None
        block.group_id = -1
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
        return True

    # ---- allocation ----
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` free blocks (LRU first), evicting their cached hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.get_num_free_blocks()} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0 and not block.is_null
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            assert not block.is_null, "the null block is never shared"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block, in eviction-priority order (evicted first comes first).

        Callers pass a request's blocks tail first, so its prefix blocks are evicted last.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # ---- stats ----
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the non-null blocks in use (0.0 for a pool with only the null block)."""
        total = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total > 0 else 0.0
