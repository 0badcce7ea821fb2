"""BlockPool and its LRU free queue: null block, eviction order, touch/free, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_factories import assert_pool_consistent

from v1.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_free_queue_popleft_remove_append_keep_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        queue.append(blocks[1])  # already a member
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])  # no longer a member
    assert _ids(queue.popleft_n(4)) == [3, 4, 2, 0]
    with pytest.raises(ValueError):
        queue.popleft()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(_ids(blocks)) == [1, 2, 3, 4]
    assert all(block.ref_cnt == 1 for block in blocks)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert 0 not in _ids(pool.get_new_blocks(4))
    assert_pool_consistent(pool)


def test_freed_blocks_are_reused_in_lru_order_and_evicted_lazily() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [_hash(i) for i in range(4)], 0, 4)
    # Free a "request" tail first: 4, 3, then another holding 2, 1.
    pool.free_blocks([blocks[3], blocks[2]])
    pool.free_blocks([blocks[1], blocks[0]])
    # Freed blocks stay in the prefix cache until popped.
    assert all(pool.get_cached_block(_hash(i)) is blocks[i] for i in range(4))
    first = pool.get_new_blocks(1)
    assert first == [blocks[3]]
    assert first[0].block_hash is None
    assert pool.get_cached_block(_hash(3)) is None
    assert pool.get_cached_block(_hash(2)) is blocks[2]
    assert pool.get_new_blocks(2) == [blocks[2], blocks[1]]
    assert pool.get_cached_block(_hash(0)) is blocks[0]
    assert_pool_consistent(pool)


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [_hash(7)], 0, 1)
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(_hash(7))
    assert hit is block
    pool.touch([hit])
    pool.touch([hit])  # a second request shares it
    assert block.ref_cnt == 2
    assert pool.get_num_free_blocks() == 2
    assert block not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 2  # still held by one request
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])
    assert_pool_consistent(pool)


def test_same_content_in_two_blocks_survives_eviction_of_one() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_hash(1)], 0, 1)
    pool.cache_full_blocks([b], [_hash(1)], 0, 1)
    pool.free_blocks([a, b])
    assert pool.get_new_blocks(1) == [a]  # evicts a's copy only
    assert pool.get_cached_block(_hash(1)) is b
    assert_pool_consistent(pool)


def test_cache_keys_are_per_group() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_hash(1)], 0, 1, group_id=0)
    pool.cache_full_blocks([b], [_hash(1)], 0, 1, group_id=1)
    assert pool.get_cached_block(_hash(1), group_id=0) is a
    assert pool.get_cached_block(_hash(1), group_id=1) is b
    assert pool.get_cached_block(_hash(1), group_id=2) is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)], 0, 2)
    assert pool.get_cached_block(_hash(0)) is None
    assert all(block.block_hash is None for block in blocks)


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)], 0, 2)
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_hash(1)) is blocks[1]
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(_hash(0)) is None
    assert all(block.block_hash is None for block in pool.blocks)
    assert_pool_consistent(pool)


def test_usage_counts_non_null_blocks() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=False)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(0.75)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert BlockPool(num_blocks=1, enable_caching=True).get_usage() == 0.0


_OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "hit", "reset"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 10), ops=_OPS)
def test_pool_invariants_under_random_operations(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    """Random allocate / free / cache / prefix-hit / reset sequences keep the pool consistent."""
    pool = BlockPool(num_blocks, enable_caching=True)
    held: list[list[KVCacheBlock]] = []  # one list per "request", in table order
    for op, arg in ops:
        if op == "alloc":
            n = arg % (num_blocks + 1)
            if n > pool.get_num_free_blocks():
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
            else:
                blocks = pool.get_new_blocks(n)
                assert all(not b.is_null and b.ref_cnt == 1 for b in blocks)
                held.append(blocks)
        elif op == "free" and held:
            blocks = held.pop(arg % len(held))
            pool.free_blocks(reversed(blocks))
        elif op == "cache" and held:
            blocks = held[arg % len(held)]
            uncached = [b for b in blocks if b.block_hash is None]
            pool.cache_full_blocks(uncached, [_hash(arg)] * len(uncached), 0, len(uncached))
        elif op == "hit":
            block = pool.get_cached_block(_hash(arg))
            if block is not None:
                num_free = pool.get_num_free_blocks()
                was_free = block.ref_cnt == 0
                pool.touch([block])
                assert pool.get_num_free_blocks() == num_free - was_free
                held.append([block])
        elif op == "reset":
            assert pool.reset_prefix_cache() == all(not blocks for blocks in held)
        assert_pool_consistent(pool)
        assert sum(b.ref_cnt for b in pool.blocks) == sum(len(blocks) for blocks in held)
    for blocks in held:
        pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert_pool_consistent(pool)
