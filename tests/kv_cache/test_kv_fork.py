"""KVCacheManager.fork_slots: a request admitted on a held request's decoder blocks shares its
full blocks, copies its partial last block (a queued (src, dst) copy) or takes it over, attaches
to the same cross-attention entry, is all-or-nothing, and frees exactly."""

from __future__ import annotations

import pytest
from kv_factories import (
    admitted,
    assert_pool_consistent,
    make_manager,
    make_request,
    snapshot,
)

from v1.core.request import Request
from v1.kv_cache import KVCacheManager


def child_of(parent: Request, req_id: str, token: int = 77) -> Request:
    """`parent`'s sequence plus one token, as the next beam step sends it."""
    child = make_request(
        req_id,
        prompt_token_ids=list(parent.prompt_token_ids),
        num_encoder_tokens=parent.num_encoder_tokens,
    )
    child.append_output_token_ids([*parent.output_token_ids, token])
    return child


def fork(
    manager: KVCacheManager, parent: Request, child: Request, move: bool = False
) -> tuple[list[int], ...] | None:
    blocks = manager.fork_slots(
        child, parent, child.num_tokens - parent.num_computed_tokens,
        num_encoder_tokens=child.num_encoder_tokens, move_last_block=move,
    )  # fmt: skip
    if blocks is None:
        return None
    child.num_computed_tokens = parent.num_computed_tokens
    return blocks.get_block_ids()


def ref_counts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[b].ref_cnt for b in block_ids]


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    manager = make_manager(num_blocks=32, block_size=4)
    parent = admitted(manager, make_request("p", prompt_len=10))  # blocks: 4 + 4 + 2 tokens
    (parent_ids,) = manager.get_block_ids("p")
    free_before = manager.num_free_blocks

    a, b = child_of(parent, "a", 5), child_of(parent, "b", 6)
    (a_ids,) = fork(manager, parent, a)
    (b_ids,) = fork(manager, parent, b)
    # Full blocks shared; each child writes its token 10 into a copy of the partial block.
    assert a_ids[:2] == b_ids[:2] == parent_ids[:2]
    assert len({a_ids[2], b_ids[2], parent_ids[2]}) == 3
    assert manager.take_block_copies() == [(parent_ids[2], a_ids[2]), (parent_ids[2], b_ids[2])]
    assert manager.take_block_copies() == []  # handed to one step only
    assert ref_counts(manager, parent_ids) == [3, 3, 1]
    assert manager.num_free_blocks == free_before - 2
    assert (manager.num_forks, manager.num_forked_tokens, manager.num_block_copies) == (2, 20, 2)
    assert_pool_consistent(manager.block_pool)

    for request in (parent, a, b):
        manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks and manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)


def test_last_fork_takes_the_partial_block_over() -> None:
    manager = make_manager(num_blocks=32, block_size=4)
    parent = admitted(manager, make_request("p", prompt_len=7))
    (parent_ids,) = manager.get_block_ids("p")
    a, b = child_of(parent, "a", 5), child_of(parent, "b", 6)
    (a_ids,) = fork(manager, parent, a)
    (b_ids,) = fork(manager, parent, b, move=True)
    # One new block for one divergence: b writes into the parent's own partial block.
    assert b_ids == parent_ids and a_ids[1] != parent_ids[1]
    assert manager.take_block_copies() == [(parent_ids[1], a_ids[1])]
    assert manager.get_block_ids("p") == ([parent_ids[0]],)  # the parent no longer has it
    manager.free(parent)
    assert ref_counts(manager, b_ids) == [2, 1]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert_pool_consistent(manager.block_pool)


def test_block_aligned_fork_copies_nothing_and_grows_one_block() -> None:
    manager = make_manager(num_blocks=32, block_size=4)
    parent = admitted(manager, make_request("p", prompt_len=8))
    (parent_ids,) = manager.get_block_ids("p")
    (child_ids,) = fork(manager, parent, child_of(parent, "c"))
    assert child_ids[:2] == parent_ids and len(child_ids) == 3
    assert manager.take_block_copies() == [] and manager.num_block_copies == 0


def test_fork_chain_keeps_the_prefix_cache_consistent() -> None:
    """Beam steps fork from forks; full blocks get registered once, under the same hashes a
    plain prefill of the sequence gives."""
    manager = make_manager(num_blocks=64, block_size=4)
    parent = admitted(manager, make_request("s0", prompt_len=3))
    for step in range(1, 12):
        child = child_of(parent, f"s{step}", 50 + step)
        assert fork(manager, parent, child, move=True) is not None
        child.num_computed_tokens += 1  # the step computes its one new token
        manager.free(parent)
        parent = child
    assert manager.take_block_copies() == []
    manager.free(parent)
    assert manager.num_free_blocks == manager.num_total_blocks
    # The 14 tokens' 3 full blocks are cached: a new request with them hits all 3.
    again = make_request("again", prompt_token_ids=parent.all_token_ids + [9])
    assert manager.get_computed_blocks(again)[1] == 12
    assert_pool_consistent(manager.block_pool)


def test_forks_read_one_cross_attention_entry() -> None:
    manager = make_manager(num_blocks=32, block_size=4, cross=True)
    parent = admitted(manager, make_request("p", prompt_len=2, num_encoder_tokens=10))
    _, cross_ids = manager.get_block_ids("p")
    children = [child_of(parent, f"c{i}", 5 + i) for i in range(3)]
    for child in children:
        _, child_cross = fork(manager, parent, child)
        assert child_cross == cross_ids
    assert ref_counts(manager, cross_ids) == [4, 4, 4]
    assert manager.num_free_blocks == manager.num_total_blocks - 1 - 3 - 3  # self, cross, copies
    for request in (parent, *children):
        manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert_pool_consistent(manager.block_pool)


@pytest.mark.parametrize("move", [False, True])
def test_fork_without_room_changes_nothing(move: bool) -> None:
    # 7 usable blocks: the parent holds 3 (10 tokens) and a filler the other 4.
    manager = make_manager(num_blocks=8, block_size=4)
    parent = admitted(manager, make_request("p", prompt_len=10))
    admitted(manager, make_request("filler", prompt_token_ids=list(range(100, 116))))
    assert manager.num_free_blocks == 0
    child = child_of(parent, "c")
    before = snapshot(manager, ["p", "filler", "c"])
    if move:
        # Taking the partial block over needs no block; the new token fits it.
        assert fork(manager, parent, child, move=True) is not None
        return
    assert fork(manager, parent, child) is None
    assert snapshot(manager, ["p", "filler", "c"]) == before
    assert manager.take_block_copies() == [] and manager.num_forks == 0


def test_freeing_a_fork_before_its_step_drops_its_copy() -> None:
    """A fork preempted (or aborted) in the step that admitted it: its copy must not run, or
    it would write a block that may belong to someone else by then."""
    manager = make_manager(num_blocks=32, block_size=4)
    parent = admitted(manager, make_request("p", prompt_len=6))
    a, b = child_of(parent, "a", 1), child_of(parent, "b", 2)
    fork(manager, parent, a)
    (b_ids,) = fork(manager, parent, b)
    manager.free(a)
    assert manager.take_block_copies() == [(manager.get_block_ids("p")[0][1], b_ids[1])]
