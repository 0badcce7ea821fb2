"""Pipelined (async) scheduling in the EngineCore: step N+1 is launched before step N is read
back, outputs equal the synchronous core's, aborts and failures of in-flight steps."""

from __future__ import annotations

import random

import pytest

from tests.core.fakes import make_config, make_engine_core, make_request, to_core_request
from tests.core.test_engine_core import drain
from v1.core.protocol import FinishReason


def pooling_core(**overrides):
    overrides.setdefault("max_num_batched_tokens", 16)
    return make_engine_core("encoder_only", async_scheduling=True, **overrides)


def add_pooling(core, n: int, prompt_len=lambda i: 8, prefix: str = "p") -> list[str]:
    ids = []
    for i in range(n):
        req = make_request(f"{prefix}{i}", prompt_len=prompt_len(i), pooling=True)
        core.add_request(to_core_request(req))
        ids.append(req.request_id)
    return ids


def test_next_step_launches_before_the_previous_is_read():
    core = pooling_core()
    add_pooling(core, 6)  # 2 requests (16 tokens) per step: 3 steps
    outs = drain(core)
    assert sorted(o.request_id for o in outs if o.finished) == [f"p{i}" for i in range(6)]
    events = core.executor.events
    assert events.index(("launch", 2)) < events.index(("read", 1))
    assert events.index(("launch", 3)) < events.index(("read", 2))
    assert [e for e in events if e[0] == "read"] == [("read", 1), ("read", 2), ("read", 3)]
    assert not core.has_work() and core.get_stats()["num_requests"] == 0


def test_outputs_equal_the_synchronous_core():
    lengths = random.Random(0).choices(range(1, 17), k=40)
    results = []
    for async_scheduling in (False, True):
        core = make_engine_core(
            "encoder_only", async_scheduling=async_scheduling, max_num_batched_tokens=16
        )
        add_pooling(core, 40, prompt_len=lambda i: lengths[i])
        outs = drain(core)
        results.append({o.request_id: o.pooled_output.tolist() for o in outs if o.finished})
    assert len(results[0]) == 40 and results[0] == results[1]


def test_abort_of_an_in_flight_step_drains_and_ids_are_reusable():
    core = pooling_core()
    ids = add_pooling(core, 3)
    first = core.step()  # launches step 1 (p0, p1); p2 waits, so it returns without reading
    assert not first.outputs and core.executor.events == [("launch", 1)]
    core.abort_requests(ids)
    assert core.has_work()  # the launched step is still to be read back
    outs = drain(core)
    assert not [o for o in outs if o.request_id in ids]  # aborted: nothing delivered
    assert core.get_stats()["num_requests"] == 0 and not core._batch_queue
    add_pooling(core, 3)  # same ids again
    outs = drain(core)
    assert sorted(o.request_id for o in outs if o.finished) == ids


def test_a_failed_read_back_fails_that_step_only():
    core = pooling_core()
    core.executor.fail_on_read = lambda so: "p0" in so.num_scheduled_tokens
    add_pooling(core, 4)
    by_id = {o.request_id: o for o in drain(core) if o.finished}
    assert by_id["p0"].finish_reason == FinishReason.ERROR and "device" in by_id["p0"].error
    assert by_id["p1"].finish_reason == FinishReason.ERROR  # same step
    assert by_id["p2"].pooled_output is not None and by_id["p3"].pooled_output is not None
    assert core.get_stats()["num_requests"] == 0


def test_randomized_pipelined_simulation_leaves_nothing_behind():
    rng = random.Random(3)
    core = pooling_core(max_num_seqs=4)
    live: set[str] = set()
    for i in range(600):
        if rng.random() < 0.4:
            req = make_request(f"q{i}", prompt_len=rng.randint(1, 16), pooling=True)
            core.add_request(to_core_request(req))
            live.add(req.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            core.abort_requests([victim])
            live.discard(victim)
        for out in core.step().outputs:
            assert out.finish_reason != FinishReason.ERROR, out.error
            assert out.request_id in live, f"{out.request_id} delivered twice or after abort"
            live.discard(out.request_id)
    core.abort_requests(sorted(live))
    drain(core)
    assert not core.scheduler.requests and not core._batch_queue
    assert len(core.executor.runner.num_tokens) <= 4  # finished ones leave the runner too


def generation_outputs(kind: str, async_scheduling: bool, n: int = 24, **overrides):
    """Drains a fake core of `n` generating requests whose tokens hit EOS at varied points;
    returns ({req_id: (tokens, finish reason)}, core)."""
    lengths = random.Random(1).choices(range(1, 30), k=n)

    def token_fn(req_id: str, num_tokens: int) -> int:
        i = int(req_id[1:])
        return 2 if num_tokens >= 8 + lengths[i] else 10 + (num_tokens * 7 + i) % 80  # 2 = EOS

    overrides.setdefault("max_num_batched_tokens", 32)
    # Explicit, so the engine does not lower it to what the small cache holds: with 16 blocks
    # the requests must outgrow the cache (preemption by recompute).
    overrides.setdefault("max_num_seqs", 128)
    # One maximal request (24 decoder tokens + 24 encoder positions) fits the smallest cache.
    overrides.setdefault("max_model_len", 24)
    overrides.setdefault("max_positions", 24)
    core = make_engine_core(kind, token_fn=token_fn, async_scheduling=async_scheduling, **overrides)
    core.num_scheduled_tokens = 0
    execute = core.executor.execute_model

    def counting_execute(so):
        core.num_scheduled_tokens += so.total_num_scheduled_tokens
        return execute(so)

    core.executor.execute_model = counting_execute
    for i in range(n):
        req = make_request(
            f"g{i}",
            prompt_len=8,
            max_tokens=5 + i % 17,
            ignore_eos=False,
            encoder_len=6 if kind == "encoder_decoder" else 0,
        )
        core.add_request(to_core_request(req))
    results: dict[str, tuple[list[int], object]] = {}
    for out in drain(core):
        tokens, _ = results.get(out.request_id, ([], None))
        assert _ is None, f"{out.request_id} got tokens after finishing"
        results[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason)
    return results, core


@pytest.mark.parametrize("kind", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("num_kv_blocks", [64, 16])  # 16: preemption by recompute
def test_pipelined_generation_equals_the_synchronous_core(kind, num_kv_blocks):
    sync, _ = generation_outputs(kind, False, num_kv_blocks=num_kv_blocks)
    piped, core = generation_outputs(kind, True, num_kv_blocks=num_kv_blocks)
    assert piped == sync and len(sync) == 24
    assert {reason for _, reason in sync.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    if num_kv_blocks == 16:
        assert core.scheduler.num_preemptions > 0
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not core.scheduler.requests
    # Two steps in flight: most read-backs come after the next step's launch.
    events = core.executor.events
    overlapped = sum(
        1 for k, e in enumerate(events) if e[0] == "read" and events[k - 1][0] == "launch"
    )
    assert overlapped >= len([e for e in events if e[0] == "read"]) // 2


def test_pipelined_generation_wastes_at_most_one_row_per_eos_stop():
    sync, sync_core = generation_outputs("decoder_only", False, max_num_seqs=8)
    piped, core = generation_outputs("decoder_only", True, max_num_seqs=8)
    # A request stopping on EOS in step N was already scheduled in step N+1: one wasted row.
    # One stopping on max_tokens never is (its in-flight token already reaches the limit).
    num_eos = sum(reason == FinishReason.STOP for _, reason in piped.values())
    wasted = core.num_scheduled_tokens - sync_core.num_scheduled_tokens
    assert 0 < wasted <= num_eos


def test_pipelined_abort_mid_run_frees_everything():
    rng = random.Random(5)
    core = make_engine_core(
        "decoder_only", async_scheduling=True, num_kv_blocks=24, max_model_len=48
    )
    live: set[str] = set()
    for i in range(300):
        if rng.random() < 0.3:
            req = make_request(
                f"a{i}", prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 20)
            )
            core.add_request(to_core_request(req))
            live.add(req.request_id)
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            core.abort_requests([victim])
            live.discard(victim)
        for out in core.step().outputs:
            assert out.finish_reason != FinishReason.ERROR, out.error
            assert out.request_id in live, f"{out.request_id} delivered after finish or abort"
            if out.finished:
                live.discard(out.request_id)
    core.abort_requests(sorted(live))
    drain(core)
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not core._batch_queue


def test_async_scheduling_defaults_on_cuda_only():
    assert not make_config("encoder_only").use_async_scheduling  # fake configs resolve to CPU
    assert make_config("encoder_only", async_scheduling=True).use_async_scheduling
    assert not make_config("decoder_only").use_async_scheduling
    assert make_config("decoder_only", async_scheduling=True).use_async_scheduling


def test_an_id_reused_while_its_aborted_step_is_in_flight_gets_its_own_result():
    core = pooling_core()
    add_pooling(core, 3)  # step 1 = p0, p1 (8 tokens each); p2 waits
    core.step()
    core.abort_requests(["p0"])
    reused = make_request("p0", prompt_len=5, pooling=True)
    core.add_request(to_core_request(reused))  # waits for step 1's read-back
    by_id = {o.request_id: o for o in drain(core) if o.finished}
    # FakeRunner pools [num computed tokens] * 4: the old p0 would give 8.
    assert by_id["p0"].pooled_output.tolist() == [5.0] * 4
    assert sorted(by_id) == ["p0", "p1", "p2"] and core.get_stats()["num_requests"] == 0
