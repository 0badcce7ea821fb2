"""KVCacheManager on decoder-only configs: prefix hits, deltas, all-or-nothing allocation,
free order and eviction."""

from __future__ import annotations

import pytest
from kv_factories import (
    admit,
    admitted,
    assert_pool_consistent,
    decode_step,
    make_manager,
    make_request,
    snapshot,
)

from v1.kv_cache import KVCacheBlocks


def test_prefix_hit_reuses_blocks_of_a_finished_request() -> None:
    manager = make_manager(num_blocks=16, block_size=4)
    a = make_request("a", prompt_len=10)
    a_ids = admit(manager, a).get_block_ids()
    assert len(a_ids[0]) == 3
    manager.free(a)
    assert manager.num_free_blocks == 15

    b = make_request("b", prompt_len=10)
    computed, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 8
    assert computed.get_block_ids() == (a_ids[0][:2],)
    new = manager.allocate_slots(b, 2, num_computed, computed)
    assert new is not None
    # The delta is the whole new table: the two hits, then one fresh block.
    assert new.get_block_ids()[0][:2] == a_ids[0][:2]
    assert len(new.get_block_ids()[0]) == 3
    assert manager.get_block_ids("b") == new.get_block_ids()
    assert manager.num_free_blocks == 12
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)
    assert_pool_consistent(manager.block_pool)


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(8, 4), (9, 8), (4, 0), (1, 0)])
def test_hit_never_covers_the_whole_prompt(prompt_len: int, expected_hit: int) -> None:
    manager = make_manager(block_size=4)
    manager.free(admitted(manager, make_request("a", prompt_len=prompt_len)))
    _, num_computed = manager.get_computed_blocks(make_request("b", prompt_len=prompt_len))
    assert num_computed == expected_hit


def test_hit_stops_at_the_first_differing_block() -> None:
    manager = make_manager(block_size=4)
    manager.free(admitted(manager, make_request("a", prompt_len=13)))
    prompt = list(range(13))
    prompt[5] = 99
    computed, num_computed = manager.get_computed_blocks(make_request("b", prompt_token_ids=prompt))
    assert num_computed == 4 and len(computed.blocks[0]) == 1


def test_requests_running_together_share_prefix_blocks() -> None:
    manager = make_manager(num_blocks=16, block_size=4)
    a = admitted(manager, make_request("a", prompt_len=10))
    b = admitted(manager, make_request("b", prompt_len=10))
    assert manager.get_block_ids("a")[0][:2] == manager.get_block_ids("b")[0][:2]
    assert manager.get_block_ids("a")[0][2] != manager.get_block_ids("b")[0][2]
    shared = manager.get_blocks("a").blocks[0][0]
    assert shared.ref_cnt == 2
    assert manager.num_free_blocks == 11
    manager.free(a)
    assert shared.ref_cnt == 1 and manager.num_free_blocks == 12
    manager.free(b)
    assert manager.num_free_blocks == 15
    assert_pool_consistent(manager.block_pool)


def test_no_hits_without_caching_or_for_pooling_requests() -> None:
    uncached = make_manager(enable_caching=False)
    uncached.free(admitted(uncached, make_request("a", prompt_len=10)))
    assert uncached.get_computed_blocks(make_request("b", prompt_len=10))[1] == 0
    assert uncached.block_pool.cached_block_hash_to_block == {}

    cached = make_manager()
    cached.free(admitted(cached, make_request("a", prompt_len=10)))
    computed, num_computed = cached.get_computed_blocks(make_request("p", 10, pooling=True))
    assert num_computed == 0 and computed.get_block_ids() == ([],)


def test_touching_free_hits_counts_against_free_blocks() -> None:
    manager = make_manager(num_blocks=5, block_size=4)  # 4 usable blocks
    manager.free(admitted(manager, make_request("a", prompt_len=9)))
    assert manager.num_free_blocks == 4
    # 17 tokens need 5 blocks: 2 free hits + 3 new, one more than the pool has.
    too_long = make_request("b", prompt_len=17)
    computed, num_computed = manager.get_computed_blocks(too_long)
    assert num_computed == 8
    before = snapshot(manager, ["b"])
    assert manager.allocate_slots(too_long, 9, num_computed, computed) is None
    assert snapshot(manager, ["b"]) == before
    assert all(block.ref_cnt == 0 for block in computed.blocks[0])
    # 16 tokens need exactly the 4 blocks: 2 hits + 2 new.
    fits = make_request("c", prompt_len=16)
    computed, num_computed = manager.get_computed_blocks(fits)
    assert manager.allocate_slots(fits, 8, num_computed, computed) is not None
    assert manager.num_free_blocks == 0
    assert_pool_consistent(manager.block_pool)


def test_failed_decode_allocation_changes_nothing() -> None:
    manager = make_manager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = admitted(manager, make_request("a", prompt_len=8))
    b = admitted(manager, make_request("b", prompt_token_ids=[50, 51, 52]))
    assert manager.num_free_blocks == 0
    assert decode_step(manager, b).get_block_ids() == ([],)  # fills b's block, no new one
    before = snapshot(manager, ["a", "b"])
    a.append_output_token_ids([1])
    assert manager.allocate_slots(a, 1) is None
    assert snapshot(manager, ["a", "b"]) == before


def test_allocate_returns_only_the_delta() -> None:
    manager = make_manager(block_size=4)
    request = make_request(prompt_len=7)
    first = admit(manager, request).get_block_ids()[0]
    assert len(first) == 2
    assert decode_step(manager, request).get_block_ids() == ([],)  # token 8 fits block 2
    [[third]] = decode_step(manager, request).get_block_ids()  # token 9 opens block 3
    assert manager.get_block_ids(request.request_id) == (first + [third],)
    assert third not in first


def test_chunked_prefill_caches_only_blocks_computed_so_far() -> None:
    manager = make_manager(block_size=4)
    request = make_request(prompt_len=12)
    assert len(admit(manager, request, num_new_tokens=5).blocks[0]) == 2
    pool = manager.block_pool
    cached = [pool.get_cached_block(h) for h in request.block_hashes]
    table = manager.get_blocks(request.request_id).blocks[0]
    assert cached == [table[0], None, None]
    new = manager.allocate_slots(request, 7)
    assert len(new.blocks[0]) == 1
    table = manager.get_blocks(request.request_id).blocks[0]
    assert [pool.get_cached_block(h) for h in request.block_hashes] == table
    assert_pool_consistent(pool)


def test_decoded_tokens_become_prefix_hits() -> None:
    manager = make_manager(block_size=4)
    a = admitted(manager, make_request("a", prompt_len=6))
    decode_step(manager, a, token=100)
    decode_step(manager, a, token=101)
    manager.free(a)
    b = make_request("b", prompt_token_ids=[0, 1, 2, 3, 4, 5, 100, 101, 9])
    assert manager.get_computed_blocks(b)[1] == 8
    c = make_request("c", prompt_token_ids=[0, 1, 2, 3, 4, 5, 100, 102, 9])
    assert manager.get_computed_blocks(c)[1] == 4


def test_free_is_idempotent_and_returns_every_block() -> None:
    manager = make_manager()
    request = admitted(manager, make_request(prompt_len=10))
    assert manager.num_requests == 1
    assert manager.usage == pytest.approx(3 / 15)
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks == 15
    assert manager.num_requests == 0 and manager.usage == 0.0
    assert manager.get_block_ids(request.request_id) == ([],)
    assert_pool_consistent(manager.block_pool)


def test_tail_blocks_are_evicted_before_prefix_blocks() -> None:
    manager = make_manager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = admitted(manager, make_request("a", prompt_len=13))
    table = manager.get_block_ids("a")[0]
    manager.free(a)
    # Two unrelated one-block requests evict a's last two blocks, not its prefix.
    admitted(manager, make_request("c", prompt_token_ids=[90, 91, 92]))
    admitted(manager, make_request("d", prompt_token_ids=[80, 81, 82]))
    assert manager.get_block_ids("c")[0] == [table[3]]
    assert manager.get_block_ids("d")[0] == [table[2]]
    computed, num_computed = manager.get_computed_blocks(make_request("b", prompt_len=13))
    assert num_computed == 8 and computed.get_block_ids() == (table[:2],)


def test_least_recently_freed_request_is_evicted_first() -> None:
    manager = make_manager(num_blocks=5, block_size=4)
    a = admitted(manager, make_request("a", prompt_token_ids=[1] * 5))
    b = admitted(manager, make_request("b", prompt_token_ids=[2] * 5))
    manager.free(a)
    manager.free(b)
    admitted(manager, make_request("c", prompt_token_ids=[3] * 8))
    assert manager.get_computed_blocks(make_request("a2", prompt_token_ids=[1] * 5))[1] == 0
    assert manager.get_computed_blocks(make_request("b2", prompt_token_ids=[2] * 5))[1] == 4


def test_reset_prefix_cache() -> None:
    manager = make_manager()
    a = admitted(manager, make_request("a", prompt_len=10))
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.get_computed_blocks(make_request("b", prompt_len=10))[1] == 8
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("c", prompt_len=10))[1] == 0


def test_slots_are_capped_at_max_model_len() -> None:
    manager = make_manager(block_size=4, max_model_len=8)
    request = make_request(prompt_len=6)
    blocks = manager.allocate_slots(request, 10)
    assert len(blocks.blocks[0]) == 2


def test_kv_cache_blocks_helpers() -> None:
    empty = KVCacheBlocks.empty(2)
    assert empty.get_block_ids() == ([], []) and empty.num_blocks == 0
    manager = make_manager()
    request = admitted(manager, make_request(prompt_len=5))
    blocks = manager.get_blocks(request.request_id)
    assert blocks.num_blocks == 2
    doubled = blocks + blocks
    assert doubled.get_block_ids() == (blocks.get_block_ids()[0] * 2,)
    with pytest.raises(AssertionError, match="different configs"):
        blocks + empty
