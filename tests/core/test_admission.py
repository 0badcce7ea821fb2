"""Admission: start-up capacity refusals naming the knob, requests that can never run rejected
alone, numbers outside their tensors' range failing only their own request, and a waiting queue
that neither blocks behind a request that cannot run now nor starves it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tests.core.fakes import (
    FakeRunner,
    make_engine_core,
    make_request,
    make_scheduler,
    run_scheduler_step,
    to_core_request,
)
from v1.core.admission import checked_id_lists, checked_ids
from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason
from v1.core.scheduler import admitter as admitter_module
from v1.core.scheduler.admitter import MAX_SKIPS_PER_STEP
from v1.kv_cache.capacity import max_tokens_that_fit, num_blocks_needed
from v1.sampling_params import SamplingParams


def drain(core, max_steps=5_000):
    outs = []
    for _ in range(max_steps):
        if not core.has_work():
            return outs
        outs.extend(core.step().outputs)
    raise AssertionError("core did not drain")


# ---- start-up ----
def test_startup_refuses_kv_cache_smaller_than_one_request():
    with pytest.raises(ValueError, match="num_kv_blocks=8") as info:
        make_engine_core(num_kv_blocks=8, block_size=4)
    # 7 usable blocks of 4 tokens: the message says what max_model_len would fit.
    assert "max_model_len <= 28" in str(info.value)
    make_engine_core(num_kv_blocks=8, block_size=4, max_model_len=28)  # and that it does


def test_startup_counts_cross_attention_blocks():
    # BART fake: 256 decoder tokens + 256 encoder positions, block 4: 64 + 64 blocks.
    with pytest.raises(ValueError, match="plus 256 encoder positions"):
        make_engine_core("encoder_decoder", num_kv_blocks=100, block_size=4)
    core = make_engine_core("encoder_decoder", num_kv_blocks=129, block_size=4)
    cfg = core.kv_cache_config
    assert num_blocks_needed(cfg, 256, 256) == 128
    assert max_tokens_that_fit(cfg, 256) == 256


def test_startup_refuses_unchunked_budget_below_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        make_engine_core(enable_chunked_prefill=False, max_num_batched_tokens=16)
    make_engine_core(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)


def test_startup_refuses_encoder_budget_below_longest_input():
    with pytest.raises(ValueError, match="encoder_cache_size=100"):
        make_engine_core("encoder_decoder", num_kv_blocks=129, block_size=4, encoder_cache_size=100)


# ---- per request ----
def _poisoned(params: SamplingParams, **changes) -> SamplingParams:
    """Params changed after their checks ran (as a buggy or hostile frontend could send)."""
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "changes",
    [
        {"top_k": 2**63},
        {"repetition_penalty": 1e300},
        {"temperature": float("nan")},
        {"min_tokens": 2**40},
        {"stop_token_ids": [2**40]},
        {"allowed_token_ids": [10**6]},
        {"forced_eos_token_id": -3},
        {"top_p": True},
    ],
    ids=lambda c: next(iter(c)),
)
def test_out_of_range_numbers_fail_only_their_request(changes):
    core = make_engine_core()
    honest = [make_request(f"ok{i}", prompt_len=5, max_tokens=4) for i in range(3)]
    for r in honest[:2]:
        core.add_request(to_core_request(r))
    bad = make_request("bad", prompt_len=5, max_tokens=4)
    core.add_request(
        EngineCoreRequest(
            request_id="bad",
            prompt_token_ids=bad.prompt_token_ids,
            sampling_params=_poisoned(SamplingParams(max_tokens=4), **changes),
        )
    )
    core.add_request(to_core_request(honest[2]))
    outs = drain(core)
    errors = [o for o in outs if o.finish_reason == FinishReason.ERROR]
    assert [o.request_id for o in errors] == ["bad"]
    assert next(iter(changes)) in errors[0].error
    for r in honest:
        assert sum(len(o.new_token_ids) for o in outs if o.request_id == r.request_id) == 4
    assert core.get_stats()["num_kv_requests"] == 0


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([0, 5, 9], [0, 5, 9]),
        ((1, 2), [1, 2]),
        ([], []),
        ([0, 10], None),
        ([-1], None),
        ([True], None),
        ([1.0], None),
        ([np.int64(1), 2, np.uint16(3)], [1, 2, 3]),  # list(array) gives numpy scalars
        ([np.int64(12)], None),
        ([np.bool_(True)], None),
        ([np.float32(1)], None),
        (["1"], None),
        ([None], None),
        ([2**70], None),
    ],
)
def test_checked_ids_takes_plain_ints_in_range_only(ids, expected):
    checked = checked_ids(ids, 10)
    assert checked == expected
    assert checked is None or (type(checked) is list and checked is not ids)
    assert checked is None or all(type(t) is int for t in checked)
    lists = checked_id_lists([[1, 2], ids], 10)
    assert lists == (None if expected is None else [[1, 2], expected])


def test_out_of_vocab_prompt_and_encoder_ids_fail_alone():
    core = make_engine_core("encoder_decoder", num_kv_blocks=129, block_size=4)
    enc = EncoderInput(num_encoder_tokens=2, content_hash="x", token_ids=[1, 10**6])
    core.add_request(
        EngineCoreRequest(
            request_id="enc",
            prompt_token_ids=[2],
            sampling_params=SamplingParams(),
            encoder_input=enc,
        )
    )
    core.add_request(
        EngineCoreRequest(
            request_id="dec", prompt_token_ids=[2, -1], sampling_params=SamplingParams()
        )
    )
    outs = drain(core)
    assert {o.request_id for o in outs if o.finish_reason == FinishReason.ERROR} == {"enc", "dec"}


def test_output_token_ids_continue_a_sequence_or_fail_alone():
    """A request carrying earlier outputs (a beam step) continues after them: they count
    toward max_tokens; out-of-vocab ids or outputs already at max_tokens fail it alone."""
    core = make_engine_core("decoder_only", num_kv_blocks=129, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for req_id, outputs in (("ok", [5, 6, 7]), ("vocab", [10**6]), ("full", [1, 2, 3, 4])):
        core.add_request(
            EngineCoreRequest(
                request_id=req_id,
                prompt_token_ids=[2, 3],
                sampling_params=params,
                output_token_ids=outputs,
            )
        )
    outs = drain(core)
    errors = {o.request_id for o in outs if o.finish_reason == FinishReason.ERROR}
    assert errors == {"vocab", "full"}
    (ok,) = [o for o in outs if o.request_id == "ok" and o.new_token_ids]
    assert len(ok.new_token_ids) == 1 and ok.finish_reason == FinishReason.LENGTH
    assert core.get_stats()["num_kv_requests"] == 0


def test_sampling_params_edge_ranges():
    for kwargs in (
        {"top_k": 2**31},
        {"repetition_penalty": 1e39},
        {"presence_penalty": float("inf")},
        {"min_tokens": 2**31},
        {"seed": 2**64},
        {"stop_token_ids": [2**31]},
        {"forced_token_ids": [[0, -1]]},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
    # Over the wire the same checks run while decoding.
    raw = msgspec.msgpack.encode({"top_k": 2**63})
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


# ---- the waiting queue ----
def test_waiting_queue_passes_over_a_request_that_cannot_run_now():
    # 15 usable blocks of 4 tokens; "big" (40-token prompt, 11 blocks) cannot start while "a"
    # holds 6 blocks, but the small requests queued behind it can.
    sched = make_scheduler(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", prompt_len=20, max_tokens=20))
    runner = FakeRunner()
    run_scheduler_step(sched, runner)
    sched.add_request(make_request("big", prompt_len=40, max_tokens=2))
    sched.add_request(make_request("s1", prompt_len=3, max_tokens=2))
    sched.add_request(make_request("s2", prompt_len=3, max_tokens=2))
    so, _ = run_scheduler_step(sched, runner)
    assert {r.req_id for r in so.scheduled_new_reqs} == {"s1", "s2"}
    assert [r.request_id for r in sched.waiting] == ["big"]  # still first in line
    for _ in range(200):
        if not sched.has_requests():
            break
        run_scheduler_step(sched, runner)
    assert not sched.has_requests() and sched.requests == {}


def test_a_request_passed_over_too_often_is_no_longer_overtaken(monkeypatch):
    limit = 5
    monkeypatch.setattr(admitter_module, "MAX_TIMES_PASSED", limit)
    sched = make_scheduler(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", prompt_len=20, max_tokens=20))
    runner = FakeRunner()
    run_scheduler_step(sched, runner)
    sched.add_request(make_request("big", prompt_len=40, max_tokens=2))
    big = sched.requests["big"]
    admitted = []
    for i in range(limit + 3):
        sched.add_request(make_request(f"s{i}", prompt_len=2, max_tokens=1))
        so, _ = run_scheduler_step(sched, runner)
        admitted += [r.req_id for r in so.scheduled_new_reqs]
    assert big.num_times_passed == limit
    assert admitted == [f"s{i}" for i in range(limit)]  # then the small ones wait behind "big"
    order = []
    for _ in range(100):
        if not sched.has_requests():
            break
        so, _ = run_scheduler_step(sched, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order[0] == "big"  # it runs as soon as "a" frees its blocks
    assert not sched.has_requests()


def test_skipping_is_bounded_per_step():
    sched = make_scheduler(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", prompt_len=20, max_tokens=20))
    runner = FakeRunner()
    run_scheduler_step(sched, runner)
    for i in range(MAX_SKIPS_PER_STEP + 3):
        sched.add_request(make_request(f"big{i}", prompt_len=40, max_tokens=2))
    sched.add_request(make_request("small", prompt_len=2, max_tokens=1))
    so, _ = run_scheduler_step(sched, runner)
    assert not so.scheduled_new_reqs  # "small" is past the look-ahead bound
    assert len(sched.waiting) == MAX_SKIPS_PER_STEP + 4


def test_groups_take_turns_in_the_waiting_queue():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(6):
        r = make_request(f"a{i}", prompt_len=3, max_tokens=1)
        r.group_id = "A"
        sched.add_request(r)
    late = make_request("b0", prompt_len=3, max_tokens=1)
    late.group_id = "B"
    sched.add_request(late)
    runner = FakeRunner()
    order = []
    for _ in range(20):
        if not sched.has_requests():
            break
        so, _ = run_scheduler_step(sched, runner)
        order += [r.req_id for r in so.scheduled_new_reqs]
    # FIFO would run b0 last; taking turns runs it right after A's first request.
    assert order[:2] == ["a0", "b0"]
    assert sorted(order) == sorted([f"a{i}" for i in range(6)] + ["b0"])


def test_group_id_crosses_the_wire():
    req = EngineCoreRequest(request_id="x", prompt_token_ids=[1], group_id="g")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert decoded.group_id == "g"
