"""Per-group managers on their own: prefix-hit search, block counting, idempotent free."""

from __future__ import annotations

from kv_factories import SPEC_KWARGS, make_request

from v1.kv_cache import BlockPool, FullAttentionManager, FullAttentionSpec, request_block_hashes


def _full_manager(num_blocks: int = 10) -> FullAttentionManager:
    pool = BlockPool(num_blocks, enable_caching=True)
    return FullAttentionManager(FullAttentionSpec(4, **SPEC_KWARGS), pool, group_id=0)


def test_longest_cache_hit_stops_at_the_first_miss_and_at_max_length() -> None:
    manager = _full_manager()
    request = make_request(prompt_len=16)
    request_block_hashes(request, 4)
    manager.allocate_new_blocks("r0", 16, 0)
    manager.cache_blocks(request, 16)
    table = manager.get_blocks("r0")
    assert manager.find_longest_cache_hit(request.block_hashes, 16) == table
    assert manager.find_longest_cache_hit(request.block_hashes, 11) == table[:2]
    hashes = list(request.block_hashes)
    hashes[1] = b"\x00" * 32
    assert manager.find_longest_cache_hit(hashes, 16) == table[:1]


def test_cache_blocks_registers_each_full_block_once() -> None:
    manager = _full_manager()
    request = make_request(prompt_len=9)
    request_block_hashes(request, 4)
    manager.allocate_new_blocks("r0", 9, 0)
    manager.cache_blocks(request, 5)
    assert manager.num_cached_blocks["r0"] == 1
    manager.cache_blocks(request, 9)
    manager.cache_blocks(request, 9)
    assert manager.num_cached_blocks["r0"] == 2
    pool = manager.block_pool
    assert [pool.get_cached_block(h) for h in request.block_hashes] == manager.get_blocks("r0")[:2]


def test_blocks_to_allocate_counts_new_blocks_and_free_hits() -> None:
    manager = _full_manager()
    request = make_request("a", prompt_len=8)
    request_block_hashes(request, 4)
    manager.allocate_new_blocks("a", 8, 0)
    manager.cache_blocks(request, 8)
    hits = manager.get_blocks("a")
    assert manager.get_num_blocks_to_allocate("b", 12, 0, hits) == 1  # hits are held by "a"
    manager.free("a")
    manager.free("a")
    assert "a" not in manager.num_cached_blocks
    assert manager.get_num_blocks_to_allocate("b", 12, 0, hits) == 3  # 1 new + 2 free hits
    assert manager.block_pool.get_num_free_blocks() == 9


def test_grow_adds_only_the_blocks_the_table_lacks() -> None:
    manager = _full_manager()
    manager.allocate_new_blocks("r0", 5, 0)  # 2 blocks of 4
    assert manager.num_blocks_to_grow("r0", 8) == 0
    assert manager.num_blocks_to_grow("r0", 9) == 1
    assert manager.num_blocks_to_grow("r0", 17) == 3
    held = list(manager.get_blocks("r0"))
    added = manager.grow("r0", 3)
    assert manager.get_blocks("r0") == held + added and len(added) == 3
    assert manager.num_blocks_to_grow("r0", 17) == 0


def test_cache_blocks_of_registers_a_batch_as_one_call_each() -> None:
    batched, single = _full_manager(), _full_manager()
    requests = [make_request(f"r{n}", prompt_len=n) for n in (5, 8, 13)]
    for manager in (batched, single):
        for request in requests:
            request_block_hashes(request, 4)
            manager.allocate_new_blocks(request.request_id, request.num_tokens, 0)
    batched.cache_blocks_of([(r, r.num_tokens) for r in requests])
    for request in requests:
        single.cache_blocks(request, request.num_tokens)
    assert batched.num_cached_blocks == single.num_cached_blocks == {"r5": 1, "r8": 2, "r13": 3}
