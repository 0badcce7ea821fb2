"""In-process EngineCore driven by a scripted executor: lifecycle, errors and a long
randomized simulation that must end with every block free."""

from __future__ import annotations

import random

from tests.core.fakes import make_engine_core, make_request, to_core_request
from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


def drain(core, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not core.has_work():
            return outs
        outs.extend(core.step().outputs)
    raise AssertionError("core did not drain")


def test_add_step_finish():
    core = make_engine_core()
    core.add_request(to_core_request(make_request("a", prompt_len=5, max_tokens=3)))
    outs = drain(core)
    tokens = [t for o in outs if o.request_id == "a" for t in o.new_token_ids]
    assert len(tokens) == 3
    assert outs[-1].finish_reason == FinishReason.LENGTH
    stats = core.get_stats()
    assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0


def test_bad_request_becomes_error_output_and_core_survives():
    core = make_engine_core(max_model_len=16)
    core.add_request(
        EngineCoreRequest(request_id="empty", prompt_token_ids=[], sampling_params=SamplingParams())
    )
    core.add_request(
        EngineCoreRequest(
            request_id="long", prompt_token_ids=[5] * 16, sampling_params=SamplingParams()
        )
    )
    core.add_request(to_core_request(make_request("ok", prompt_len=4, max_tokens=2)))
    core.add_request(to_core_request(make_request("ok", prompt_len=4, max_tokens=2)))  # dup id
    outs = drain(core)
    errors = {o.request_id: o.error for o in outs if o.finish_reason == FinishReason.ERROR}
    assert "empty" in errors and "long" in errors and "already in use" in errors["ok"]
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "ok") == 2


def test_failed_step_fails_its_requests_only():
    fail_once = {"done": False}

    def fail_on(so):
        if "boom" in so.num_scheduled_tokens and not fail_once["done"]:
            fail_once["done"] = True
            return True
        return False

    core = make_engine_core(fail_on=fail_on, max_num_seqs=1)
    core.add_request(to_core_request(make_request("boom", prompt_len=4, max_tokens=2)))
    core.add_request(to_core_request(make_request("fine", prompt_len=4, max_tokens=2)))
    outs = drain(core)
    by_id = {o.request_id: o for o in outs if o.finished}
    assert by_id["boom"].finish_reason == FinishReason.ERROR and "scripted" in by_id["boom"].error
    assert by_id["fine"].finish_reason == FinishReason.LENGTH
    assert core.get_stats()["num_kv_requests"] == 0


def test_abort_mid_decode():
    core = make_engine_core()
    core.add_request(to_core_request(make_request("a", prompt_len=5, max_tokens=100)))
    core.step()
    core.step()
    core.abort_requests(["a", "unknown"])
    drain(core)
    assert core.get_stats()["num_used_blocks"] <= core.kv_cache_config.num_blocks
    assert core.scheduler.kv_cache_manager.num_requests == 0


def _random_request(rng: random.Random, i: int, kind: str) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5)
    if kind == "encoder_only":
        return EngineCoreRequest(
            request_id=f"q{i}",
            prompt_token_ids=[5] * rng.randint(1, 30),
            pooling_params=PoolingParams(),
        )
    encoder_input = None
    prompt = [rng.randint(3, 90) for _ in range(rng.randint(1, 50))]
    if kind == "encoder_decoder":
        n = rng.randint(1, 40)
        encoder_input = EncoderInput(
            num_encoder_tokens=n, content_hash=f"h{rng.randint(0, 20)}-{n}", token_ids=[1] * n
        )
        prompt = prompt[: rng.randint(1, 3)]
    return EngineCoreRequest(
        request_id=f"q{i}",
        prompt_token_ids=prompt,
        sampling_params=params,
        encoder_input=encoder_input,
        eos_token_id=2,
    )


def _simulate(kind: str, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    core = make_engine_core(
        kind,
        token_fn=lambda rid, n: rng.choice([2, 7, 8, 9, 10, 11]),
        num_kv_blocks=40,
        block_size=4,
        max_positions=56,  # one longest request (56 tokens + 56 encoder positions) fits
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_num_encoder_input_tokens=60,
        encoder_cache_size=80,
        policy=rng.choice(["fcfs", "priority"]),
    )
    live: set[str] = set()
    finished = 0
    for i in range(steps):
        if rng.random() < 0.3:
            req = _random_request(rng, i, kind)
            req.priority = rng.randint(0, 3)
            core.add_request(req)
            live.add(req.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            core.abort_requests([victim])
            live.discard(victim)
        for out in core.step().outputs:
            if out.finished:
                assert out.finish_reason != FinishReason.ERROR, out.error
                live.discard(out.request_id)
                finished += 1
        kv = core.scheduler.kv_cache_manager
        assert 0 <= kv.num_free_blocks <= kv.num_total_blocks
    core.abort_requests(sorted(live))
    drain(core)
    kv = core.scheduler.kv_cache_manager
    assert finished > steps // 20
    if kind != "encoder_only":
        assert core.scheduler.num_preemptions > 0, "the simulation should exercise preemption"
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert not core.scheduler.requests
    assert not core.scheduler.encoder_cache.refs or all(
        not refs for refs in core.scheduler.encoder_cache.refs.values()
    )


def test_randomized_simulation_decoder_only():
    _simulate("decoder_only", seed=0, steps=3000)


def test_randomized_simulation_encoder_decoder():
    _simulate("encoder_decoder", seed=1, steps=3000)


def test_randomized_simulation_encoder_only():
    _simulate("encoder_only", seed=2, steps=1000)


def test_ready_line_of_an_encoder_only_core_says_it_has_no_kv_cache(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="v1.core.engine_core"):
        make_engine_core("encoder_only")
        make_engine_core("decoder_only")
    lines = [r.getMessage() for r in caplog.records if "EngineCore ready" in r.getMessage()]
    assert lines[0] == "EngineCore ready: no KV cache (encoder-only)"
    assert lines[1].startswith("EngineCore ready: 65 KV blocks of 4 tokens")
