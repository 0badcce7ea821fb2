"""Fair shares of the running batch: one group (a client request, its n children included) that
fills every slot yields slots to groups that arrive later, so their requests are admitted within
one step and finish within a bounded number of steps; alone, a group still fills the batch."""

from __future__ import annotations

import pytest

from tests.core.fakes import FakeRunner, make_request, make_scheduler, run_scheduler_step
from v1.core.request import Request


def grouped(req_id: str, group: str, **kwargs) -> Request:
    request = make_request(req_id, **kwargs)
    request.group_id = group
    return request


def add_big_group(sched, n: int, max_tokens: int = 200, priority: int = 0) -> None:
    for i in range(n):
        sched.add_request(grouped(f"big-{i}", "big", max_tokens=max_tokens, priority=priority))


def steps_until_finished(sched, runner, req_id: str, limit: int = 500) -> tuple[int, int]:
    """(steps until `req_id` is first scheduled, steps until it finishes)."""
    first = None
    for step in range(1, limit + 1):
        so, out = run_scheduler_step(sched, runner)
        if first is None and req_id in so.num_scheduled_tokens:
            first = step
        if any(o.request_id == req_id and o.finish_reason is not None for o in out.outputs):
            return first, step
    raise AssertionError(f"{req_id} did not finish in {limit} steps")


def assert_all_free(sched) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not sched.requests


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_small_request_is_admitted_next_step_while_one_group_fills_the_batch(policy) -> None:
    sched, runner = make_scheduler(max_num_seqs=8, num_kv_blocks=256, policy=policy), FakeRunner()
    add_big_group(sched, 16)
    for _ in range(3):
        run_scheduler_step(sched, runner)
    assert len(sched.running) == 8  # alone, the group fills the batch (8 more wait)
    sched.add_request(grouped("small", "small", max_tokens=5))
    first, done = steps_until_finished(sched, runner, "small")
    assert first == 1  # admitted the very next step
    assert done <= 5 + 1  # prefill + 4 decode steps (+ one of slack), not ~200 steps
    assert sched.fair_share.num_fair_preemptions == 1
    while sched.has_requests():  # the preempted child resumes and every request completes
        run_scheduler_step(sched, runner)
    assert_all_free(sched)


def test_every_waiting_group_gets_a_slot_and_the_big_group_keeps_its_share() -> None:
    sched, runner = make_scheduler(max_num_seqs=8, num_kv_blocks=256), FakeRunner()
    add_big_group(sched, 8)
    run_scheduler_step(sched, runner)
    for i in range(3):
        sched.add_request(grouped(f"s{i}", f"client{i}", max_tokens=50))
    so, _ = run_scheduler_step(sched, runner)
    assert {"s0", "s1", "s2"} <= {r.req_id for r in so.scheduled_new_reqs}
    counts = {}
    for r in sched.running:
        counts[r.group_id] = counts.get(r.group_id, 0) + 1
    # share = 8 // 4 groups = 2; the big group gave up only what the others needed
    assert counts == {"big": 5, "client0": 1, "client1": 1, "client2": 1}


def test_capped_groups_still_fill_the_batch_around_a_waiting_group() -> None:
    sched, runner = make_scheduler(max_num_seqs=4, num_kv_blocks=256), FakeRunner()
    add_big_group(sched, 10, max_tokens=3)
    run_scheduler_step(sched, runner)
    sched.add_request(grouped("late", "other", max_tokens=40))
    while sched.has_requests():
        num_unfinished = len(sched.requests)
        late_unfinished = "late" in sched.requests
        so, _ = run_scheduler_step(sched, runner)
        # the batch is as full as the unfinished requests allow, and "late" is always in it
        assert len(so.num_scheduled_tokens) == min(4, num_unfinished)
        assert late_unfinished == ("late" in so.num_scheduled_tokens)
    assert_all_free(sched)


def test_no_preemption_when_every_group_runs_one_request() -> None:
    sched, runner = make_scheduler(max_num_seqs=4, num_kv_blocks=256), FakeRunner()
    for i in range(12):
        sched.add_request(grouped(f"r{i}", f"g{i}", max_tokens=6))
    while sched.has_requests():
        run_scheduler_step(sched, runner)
    assert sched.fair_share.num_fair_preemptions == 0 and sched.num_preemptions == 0


def test_priority_policy_never_preempts_a_higher_priority_group_for_a_lower_one() -> None:
    sched = make_scheduler(max_num_seqs=4, num_kv_blocks=256, policy="priority")
    runner = FakeRunner()
    add_big_group(sched, 4, priority=0)
    run_scheduler_step(sched, runner)
    sched.add_request(grouped("low", "low", max_tokens=3, priority=5))
    for _ in range(5):
        so, _ = run_scheduler_step(sched, runner)
        assert "low" not in so.num_scheduled_tokens
    assert sched.fair_share.num_fair_preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fair_preemption_in_the_engine_core_keeps_every_token(async_scheduling) -> None:
    """Preempting a child with steps in flight (pipelined) loses no token and ends clean."""
    from tests.core.fakes import make_engine_core, to_core_request
    from tests.core.test_engine_core import drain

    core = make_engine_core(max_num_seqs=4, num_kv_blocks=256, async_scheduling=async_scheduling)

    def add(req_id: str, group: str, max_tokens: int) -> None:
        request = to_core_request(make_request(req_id, max_tokens=max_tokens))
        request.group_id = group  # what AsyncLLM sets per client request
        core.add_request(request)

    for i in range(4):
        add(f"big-{i}", "big", 30)
    outs = []
    for _ in range(4):
        outs.extend(core.step().outputs)
    add("small", "small", 4)
    outs.extend(drain(core))
    tokens: dict[str, list[int]] = {}
    order = []
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            order.append(o.request_id)
    assert {r: len(t) for r, t in tokens.items()} == {
        **{f"big-{i}": 30 for i in range(4)},
        "small": 4,
    }
    assert order[0] == "small"  # not behind 30-token requests that held every slot
    assert core.scheduler.fair_share.num_fair_preemptions == 1
    assert core.get_stats()["num_requests"] == 0
