"""Property test: random admit / chunked prefill / decode / preempt / finish sequences on an
encoder-decoder config never leak, double-free or mis-size a block table, and readers of one
encoder input share one cross entry."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_factories import (
    admit,
    assert_pool_consistent,
    decode_step,
    make_manager,
    make_request,
    snapshot,
)

from v1.core.request import Request
from v1.kv_cache import KVCacheManager
from v1.kv_cache.capacity import cdiv

PROMPTS = [list(range(9)), list(range(5)), [*range(5), 42, 43, 44], [7] * 12]
ENCODER_TOKENS = [0, 3, 9]


def _check(manager: KVCacheManager, running: list[Request], block_size: int) -> None:
    pool = manager.block_pool
    assert_pool_consistent(pool)
    tables = {r.request_id: manager.get_blocks(r.request_id).blocks for r in running}
    assert sum(b.ref_cnt for b in pool.blocks) == sum(
        len(group) for groups in tables.values() for group in groups
    )
    for request in running:
        self_blocks, cross_blocks = tables[request.request_id]
        assert len(self_blocks) == cdiv(request.num_computed_tokens, block_size)
        assert len(cross_blocks) == cdiv(request.num_encoder_tokens, block_size)
        assert len({b.block_id for b in self_blocks + cross_blocks}) == len(
            self_blocks + cross_blocks
        )
        # One cross entry per encoder input: every reader of a content hash holds its blocks.
        same_input = [r for r in running if r.encoder_hash == request.encoder_hash]
        assert all(tables[r.request_id][1] == cross_blocks for r in same_input)
        assert all(b.ref_cnt == len(same_input) for b in cross_blocks)
        assert all(not b.is_null for b in self_blocks + cross_blocks)
    assert manager.num_requests == sum(1 for r in running if any(tables[r.request_id]))


def _preempt(
    manager: KVCacheManager, request: Request, running: list[Request], waiting: list[Request]
) -> None:
    running.remove(request)
    manager.free(request)
    request.num_computed_tokens = 0
    waiting.append(request)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(3, 16),
    block_size=st.sampled_from([2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "preempt", "finish"]), st.integers(0, 11)),
        max_size=40,
    ),
)
def test_random_schedules_keep_the_cache_consistent(
    num_blocks: int, block_size: int, ops: list[tuple[str, int]]
) -> None:
    manager = make_manager(num_blocks=num_blocks, block_size=block_size, cross=True)
    waiting: list[Request] = []
    running: list[Request] = []
    for i, (op, arg) in enumerate(ops):
        if op == "add":
            if waiting and arg % 2:
                request = waiting.pop(0)  # a preempted or never-fitting request
            else:
                request = make_request(
                    f"r{i}",
                    prompt_token_ids=list(PROMPTS[arg % len(PROMPTS)]),
                    num_encoder_tokens=ENCODER_TOKENS[arg % len(ENCODER_TOKENS)],
                    # A content hash stands for one input, so one length.
                    encoder_hash=f"audio-{arg % 2}-{ENCODER_TOKENS[arg % len(ENCODER_TOKENS)]}",
                )
            chunk = None if arg < 6 else max(1, request.num_tokens // 2)
            before = snapshot(manager, [request.request_id])
            blocks = admit(manager, request, num_new_tokens=chunk)
            if blocks is None:
                assert snapshot(manager, [request.request_id]) == before
            (running if blocks is not None else waiting).append(request)
        elif op == "step" and running:
            request = running[arg % len(running)]
            if request.num_computed_tokens < request.num_tokens:
                remaining = request.num_tokens - request.num_computed_tokens
                blocks = manager.allocate_slots(request, remaining)
                if blocks is not None:
                    request.num_computed_tokens += remaining
            else:
                blocks = decode_step(manager, request, token=arg)
            if blocks is None:  # out of blocks: preempt it by recompute
                _preempt(manager, request, running, waiting)
        elif op == "preempt" and running:
            _preempt(manager, running[arg % len(running)], running, waiting)
        elif op == "finish" and running:
            manager.free(running.pop(arg % len(running)))
        _check(manager, running, block_size)
    for request in running + waiting:
        manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks == num_blocks - 1
    assert manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)
