"""The scheduler's decode fast paths (room checked against request.num_kv_slots, tables grown
by KVCacheManager._grow, filled blocks registered together after the running loop) give the
same steps, outputs and KV cache state as the general allocation path."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from tests.core.fakes import FakeRunner, make_request, make_scheduler, rng
from v1.core.scheduler import Scheduler
from v1.kv_cache.manager import KVCacheManager, _Allocation


def use_general_allocation(scheduler: Scheduler) -> None:
    """The KV manager as before its fast paths: num_kv_slots stays 0 (every running request
    calls allocate_slots) and a table that must grow takes `_allocate`, registering its filled
    blocks at once."""
    kv = scheduler.kv_cache_manager
    kv._update_num_kv_slots = lambda request: None  # type: ignore[method-assign]
    allocate_slots = kv.allocate_slots

    def general(request, num_new_tokens, *args: Any, **kwargs: Any):
        if (
            args
            or kwargs.get("new_computed_blocks") is not None
            or kwargs.get("num_encoder_tokens")
        ):
            return allocate_slots(request, num_new_tokens, *args, **kwargs)
        num_tokens = min(request.num_computed_tokens + num_new_tokens, kv.max_model_len)
        if kv._full_managers and all(
            len(m.req_to_blocks.get(request.request_id, ())) * m.block_size >= num_tokens
            for m in kv._full_managers
        ):
            return kv.NO_NEW_BLOCKS
        return kv._allocate(request, _Allocation(num_new_tokens, 0, 0), kv._empty())

    kv.allocate_slots = general  # type: ignore[method-assign]


def pool_state(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        [(block.ref_cnt, block.block_hash, block.group_id) for block in pool.blocks],
        {key: list(blocks) for key, blocks in pool.cached_block_hash_to_block.items()},
    )


def step_record(so: Any) -> tuple:
    cached = so.scheduled_cached_reqs
    return (
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs],
        (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens),
        list(so.num_scheduled_tokens.items()),
        sorted(so.finished_req_ids),
        so.encoder_reqs,
        so.block_copies,
    )


def run(kind: str, seed: int, fast: bool, **overrides: Any) -> list:
    """A pipelined run (two steps in flight) of requests with shared prompt prefixes arriving
    over time, in a KV cache small enough to preempt; the record of every step."""
    scheduler = make_scheduler(kind, **overrides)
    if not fast:
        use_general_allocation(scheduler)
    r = rng(seed)
    prefixes = [[3 + r.randrange(90) for _ in range(r.randrange(4, 14))] for _ in range(3)]
    arrivals = []
    for i in range(24):
        prompt = r.choice(prefixes) + [3 + r.randrange(90) for _ in range(r.randrange(1, 7))]
        request = make_request(
            f"r{i}",
            max_tokens=r.randrange(1, 40),
            prompt=prompt,
            encoder_len=r.choice([0, 6, 9]) if kind == "encoder_decoder" else 0,
            encoder_hash=f"audio{r.randrange(3)}",
            arrival_time=float(i),
        )
        arrivals.append((r.randrange(30), request))
    runner = FakeRunner(lambda req_id, n: 3 + (n * 7 + len(req_id)) % 90)
    queue: deque = deque()
    record = []
    for step in range(400):
        for at, request in arrivals:
            if at == step:
                scheduler.add_request(request)
        if len(queue) < 2 and (
            scheduler.has_unscheduled_requests() or scheduler.has_finished_requests
        ):
            so = scheduler.schedule()
            record.append(("schedule", step_record(so), pool_state(scheduler.kv_cache_manager)))
            if so.total_num_scheduled_tokens:
                queue.append((so, runner(so)))
        if queue and (len(queue) == 2 or not scheduler.has_unscheduled_requests()):
            so, out = queue.popleft()
            outputs = scheduler.update_from_output(so, out)
            record.append(
                (
                    "update",
                    [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs.outputs],
                    {rid: list(req.block_hashes) for rid, req in scheduler.requests.items()},
                    pool_state(scheduler.kv_cache_manager),
                )
            )
        if step > 30 and not scheduler.has_requests() and not queue:
            break
    assert not scheduler.has_requests(), "the run did not finish"
    kv = scheduler.kv_cache_manager
    record.append(("stats", scheduler.num_preemptions, kv.prefix_cache_hits))
    return record


@pytest.mark.parametrize("kind", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_fast_paths_match_the_general_path(kind, seed):
    overrides = {"num_kv_blocks": 48, "block_size": 4, "max_num_batched_tokens": 32}
    fast = run(kind, seed, fast=True, **overrides)
    general = run(kind, seed, fast=False, **overrides)
    assert len(fast) == len(general)
    for i, (a, b) in enumerate(zip(fast, general, strict=True)):
        assert a == b, f"record {i} differs"
    # The scenario exercises what the fast paths must keep: growth at block boundaries,
    # prefix-cache hits on blocks registered by running requests, preemption.
    grown = sum(
        1 for rec in fast if rec[0] == "schedule" and any(ids is not None for ids in rec[1][1][1])
    )
    assert grown > 10
    _, num_preemptions, prefix_cache_hits = fast[-1]
    assert num_preemptions > 0 and prefix_cache_hits > 0


def test_num_kv_slots_never_exceeds_the_tables():
    scheduler = make_scheduler(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    kv = scheduler.kv_cache_manager
    runner = FakeRunner()
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", prompt_len=5 + i, max_tokens=20))
    seen = set()
    while scheduler.has_requests():
        so = scheduler.schedule()
        for request in scheduler.running:
            held = len(kv.get_blocks(request.request_id).blocks[0]) * 4
            assert 0 < request.num_kv_slots <= held
            seen.add(request.num_kv_slots == held)
        scheduler.update_from_output(so, runner(so))
    assert seen == {True}
