"""Scheduler behaviour: token budget, chunked prefill, preemption, encoder budget and cache."""

from __future__ import annotations

import pytest

from tests.core.fakes import (
    FakeRunner,
    make_request,
    make_requests,
    make_scheduler,
    run_scheduler_step,
)
from v1.core.request import RequestStatus


def run_to_completion(scheduler, runner, max_steps=10_000):
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        so, out = run_scheduler_step(scheduler, runner)
        outputs.append((so, out))
    raise AssertionError("scheduler did not finish")


def assert_all_free(scheduler):
    kv = scheduler.kv_cache_manager
    assert kv.num_requests == 0
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=10, num_kv_blocks=64)
    sched.add_request(make_request("a", prompt_len=25, max_tokens=3))
    runner = FakeRunner()
    chunks = []
    for _ in range(3):
        so, out = run_scheduler_step(sched, runner)
        chunks.append(so.num_scheduled_tokens["a"])
        assert so.total_num_scheduled_tokens <= 10
    assert chunks == [10, 10, 5]
    # The last chunk reached the end of the prompt: one token generated.
    assert sched.requests["a"].num_output_tokens == 1
    run_to_completion(sched, runner)
    assert_all_free(sched)


def test_no_chunking_waits_for_room():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", prompt_len=6))
    sched.add_request(make_request("b", prompt_len=6))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for r in make_requests(5, prompt_len=3, max_tokens=2):
        sched.add_request(r)
    so, _ = run_scheduler_step(sched, FakeRunner())
    assert len(so.num_scheduled_tokens) == 2


def test_new_then_cached_deltas():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_len=3, max_tokens=5))
    runner = FakeRunner()
    so1, _ = run_scheduler_step(sched, runner)
    assert [r.req_id for r in so1.scheduled_new_reqs] == ["a"]
    assert so1.scheduled_new_reqs[0].block_ids == sched.kv_cache_manager.get_block_ids("a")
    so2, _ = run_scheduler_step(sched, runner)
    assert not so2.scheduled_new_reqs
    assert so2.scheduled_cached_reqs.req_ids == ["a"]
    assert so2.scheduled_cached_reqs.num_computed_tokens == [3]
    # Block size 4: token 4 (index 3) fits the first block, no new block yet.
    assert so2.scheduled_cached_reqs.new_block_ids == [None]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_order(policy):
    # 3 requests of 8-token prompts need 2 blocks each, growing; 7 usable blocks force preemption.
    sched = make_scheduler(num_kv_blocks=8, policy=policy, enable_prefix_caching=False)
    reqs = [
        make_request(
            f"r{i}", prompt_len=8, max_tokens=8, priority=[2, 0, 1][i], arrival_time=float(i)
        )
        for i in range(3)
    ]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner()
    victims = []
    for _ in range(200):
        if not sched.has_requests():
            break
        before = {r.request_id for r in sched.running}
        run_scheduler_step(sched, runner)
        for rid in before:
            req = next((r for r in reqs if r.request_id == rid), None)
            if req.status == RequestStatus.PREEMPTED and rid not in victims:
                victims.append(rid)
    assert victims, "expected a preemption"
    # fcfs preempts the latest arrival; priority preempts the largest priority value.
    assert victims[0] == "r2" if policy == "fcfs" else victims[0] == "r0"
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert sched.num_preemptions >= 1
    assert_all_free(sched)


def test_preempted_request_comes_back_with_its_tokens():
    sched = make_scheduler(num_kv_blocks=6, enable_prefix_caching=False)
    for r in make_requests(2, prompt_len=8, max_tokens=6):
        sched.add_request(r)
    runner = FakeRunner()
    resumed = []
    for _ in range(200):
        if not sched.has_requests():
            break
        so, _ = run_scheduler_step(sched, runner)
        resumed += [n for n in so.scheduled_new_reqs if n.output_token_ids]
    assert resumed, "expected a preempted request to resume"
    assert all(n.num_computed_tokens == 0 for n in resumed)
    assert_all_free(sched)


def test_priority_admission_order():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("low", priority=5, arrival_time=0))
    sched.add_request(make_request("high", priority=1, arrival_time=1))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["high"]


def test_abort_frees_everything():
    sched = make_scheduler()
    for r in make_requests(4, prompt_len=9, max_tokens=50):
        sched.add_request(r)
    runner = FakeRunner()
    run_scheduler_step(sched, runner)
    sched.finish_requests(["r0", "r3", "nope"], RequestStatus.FINISHED_ABORTED)
    so, _ = run_scheduler_step(sched, runner)
    assert {"r0", "r3"} <= so.finished_req_ids
    sched.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_stop_checks():
    sched = make_scheduler(max_model_len=12)
    eos_req = make_request("eos", prompt_len=3, max_tokens=10, ignore_eos=False)
    stop_req = make_request("stop", prompt_len=3, max_tokens=10)
    stop_req.sampling_params = stop_req.sampling_params.clone(stop_token_ids=[17])
    len_req = make_request("len", prompt_len=9, max_tokens=100)
    for r in (eos_req, stop_req, len_req):
        sched.add_request(r)
    tokens = {"eos": [5, 2], "stop": [5, 6, 17], "len": [7] * 10}
    runner = FakeRunner(
        lambda rid, n: tokens[rid][min(n - (3 if rid != "len" else 9), len(tokens[rid]) - 1)]
    )
    run_to_completion(sched, runner)
    assert eos_req.output_token_ids == [5, 2] and eos_req.status == RequestStatus.FINISHED_STOPPED
    assert stop_req.output_token_ids == [5, 6, 17] and stop_req.stop_reason == 17
    # max_model_len 12 - prompt 9 = 3 tokens.
    assert len_req.num_output_tokens == 3 and len_req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_defers_eos():
    sched = make_scheduler()
    req = make_request("a", prompt_len=2, max_tokens=10, ignore_eos=False)
    req.sampling_params = req.sampling_params.clone(min_tokens=3)
    sched.add_request(req)
    run_to_completion(sched, FakeRunner(lambda rid, n: 2))
    assert req.num_output_tokens == 3


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler(block_size=4)
    prompt = list(range(3, 15))  # 12 tokens = 3 full blocks
    sched.add_request(make_request("a", prompt=prompt, max_tokens=1))
    runner = FakeRunner()
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt=prompt, max_tokens=1))
    so = sched.schedule()
    # 2 full blocks reused (the last token is always recomputed, so the third block is not).
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens["b"] == 4


def test_pooling_requests_run_whole_and_finish():
    sched = make_scheduler("encoder_only", max_num_batched_tokens=16)
    for r in make_requests(3, prompt_len=10, pooling=True):
        sched.add_request(r)
    runner = FakeRunner()
    so, out = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"r0": 10}  # r1 does not fit the 6 left and is not chunked
    assert out.outputs[0].finished and out.outputs[0].pooled_output[0] == 10
    run_to_completion(sched, runner)
    assert not sched.requests


# ---- encoder-decoder ----


def test_cross_blocks_allocated_once_and_freed():
    sched = make_scheduler("encoder_decoder", block_size=4, num_kv_blocks=64)
    req = make_request("a", prompt_len=1, max_tokens=6, encoder_len=10)
    sched.add_request(req)
    runner = FakeRunner()
    so, _ = run_scheduler_step(sched, runner)
    self_ids, cross_ids = so.scheduled_new_reqs[0].block_ids
    assert len(cross_ids) == 3  # ceil(10 / 4)
    assert so.encoder_reqs == ["a"] and so.encoder_hashes_to_run == {"h-a": "a"}
    for _ in range(5):
        so, _ = run_scheduler_step(sched, runner)
        for blocks in so.scheduled_cached_reqs.new_block_ids:
            assert blocks is None or not blocks[1], "cross blocks must never grow"
        assert not so.encoder_reqs
    assert req.is_finished
    assert_all_free(sched)


def test_encoder_budget_and_cache_capacity():
    sched = make_scheduler(
        "encoder_decoder", max_num_encoder_input_tokens=20, encoder_cache_size=30, num_kv_blocks=128
    )
    for r in make_requests(4, prompt_len=1, max_tokens=6, encoder_len=10):
        sched.add_request(r)
    runner = FakeRunner()
    so, _ = run_scheduler_step(sched, runner)
    assert len(so.encoder_hashes_to_run) == 2  # 20-position budget per step
    so, _ = run_scheduler_step(sched, runner)
    # The first two wrote their cross K/V in step 1: their cached outputs no longer hold room,
    # so the 30-position cache admits two more (evicting one of the old entries).
    assert len(so.encoder_hashes_to_run) == 2 and len(so.free_encoder_hashes) == 1
    assert len(sched.running) == 4
    run_to_completion(sched, runner)
    assert runner.num_encoder_runs == 4
    assert sched.encoder_cache.num_free_slots + sum(sched.encoder_cache.freeable.values()) == 30
    assert_all_free(sched)


def test_same_encoder_input_runs_once():
    sched = make_scheduler("encoder_decoder", num_kv_blocks=128)
    for i in range(3):
        sched.add_request(
            make_request(f"r{i}", prompt_len=1, max_tokens=3, encoder_len=8, encoder_hash="same")
        )
    runner = FakeRunner()
    so, _ = run_scheduler_step(sched, runner)
    assert so.encoder_hashes_to_run == {"same": "r0"}
    # One cross entry: r0 projects it, r1 and r2 attach to its blocks and only read.
    assert so.encoder_reqs == ["r0"]
    cross = {tuple(r.block_ids[1]) for r in so.scheduled_new_reqs}
    assert len(cross) == 1
    run_to_completion(sched, runner)
    # A later request with the same content attaches to the cached cross blocks.
    sched.add_request(
        make_request("late", prompt_len=1, max_tokens=1, encoder_len=8, encoder_hash="same")
    )
    so, _ = run_scheduler_step(sched, runner)
    assert so.encoder_hashes_to_run == {} and so.encoder_reqs == []
    assert so.scheduled_new_reqs[0].block_ids[1] == list(cross.pop())
    assert runner.num_encoder_runs == 1 and sched.admitter.num_cross_cache_hits == 3
    run_to_completion(sched, runner)
    assert_all_free(sched)


def test_encoder_decoder_preemption_frees_cross_blocks_and_rewrites_them():
    sched = make_scheduler(
        "encoder_decoder", block_size=4, num_kv_blocks=10, enable_prefix_caching=False
    )
    reqs = make_requests(3, prompt_len=1, max_tokens=12, encoder_len=8)
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner()
    run_to_completion(sched, runner)
    assert sched.num_preemptions > 0
    preempted = [r for r in reqs if r.num_preemptions]
    for r in preempted:  # cross K/V written again on resume
        assert runner.cross_writes.count(r.request_id) == 1 + r.num_preemptions
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert_all_free(sched)
