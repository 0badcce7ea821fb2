"""Decode bursts (SchedulerConfig.num_scheduler_steps): when every scheduled request decodes,
one step runs several decode steps; its KV slots are allocated up front, every request samples
that many tokens, and the update takes them (up to each request's stop)."""

from __future__ import annotations

from msgspec.structs import replace

from tests.core.fakes import make_request, make_scheduler
from v1.core.request import RequestStatus
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.structured_output.params import StructuredOutputsParams


def burst_output(so: SchedulerOutput, token: int = 11) -> ModelRunnerOutput:
    """What the runner reads back: num_decode_steps tokens for each request (one when the
    step only computes a prompt's last chunk, as below)."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[[token] * so.num_decode_steps for _ in req_ids]
    )


def test_decoding_batch_runs_bursts_with_slots_for_every_token() -> None:
    sched = make_scheduler(num_scheduler_steps=4, block_size=4)
    sched.add_request(make_request("a", prompt_len=5, max_tokens=20))
    sched.add_request(make_request("b", prompt_len=2, max_tokens=20))
    first = sched.schedule()
    assert first.num_decode_steps == 1  # admissions (prompts) run alone
    sched.update_from_output(first, burst_output(first))
    so = sched.schedule()
    assert so.num_decode_steps == 4 and so.num_scheduled_tokens == {"a": 1, "b": 1}
    for req_id, computed in (("a", 5), ("b", 2)):
        request = sched.requests[req_id]
        assert request.num_computed_tokens == computed + 4
        assert request.num_output_placeholders == 4
        # Slots for the 4 tokens the burst computes: positions computed .. computed + 3.
        blocks = sched.kv_cache_manager.get_block_ids(req_id)[0]
        assert len(blocks) * 4 >= computed + 4
    # The runner's tables got the blocks added for the burst (b grew from 1 to 2 blocks).
    cached = so.scheduled_cached_reqs
    new_blocks = dict(zip(cached.req_ids, cached.new_block_ids, strict=True))
    assert new_blocks["b"] is not None and len(new_blocks["b"][0]) == 1
    outs = sched.update_from_output(so, burst_output(so))
    assert [o.new_token_ids for o in outs.outputs] == [[11] * 4, [11] * 4]
    assert sched.requests["a"].num_output_tokens == 5
    assert sched.requests["a"].num_output_placeholders == 0


def test_burst_samples_past_max_tokens_and_the_update_drops_them() -> None:
    sched = make_scheduler(num_scheduler_steps=8, num_kv_blocks=64)
    sched.add_request(make_request("a", prompt_len=3, max_tokens=4))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=30))
    so = sched.schedule()
    sched.update_from_output(so, burst_output(so))
    so = sched.schedule()
    assert so.num_decode_steps == 8
    outs = sched.update_from_output(so, burst_output(so))
    by_id = {o.request_id: o for o in outs.outputs}
    assert len(by_id["a"].new_token_ids) == 3 and by_id["a"].finish_reason is not None
    assert len(by_id["b"].new_token_ids) == 8 and by_id["b"].finish_reason is None
    assert "a" not in sched.requests  # finished and freed
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.num_decode_steps == 8


def test_max_model_len_shortens_a_burst() -> None:
    sched = make_scheduler(num_scheduler_steps=8, max_model_len=12, num_kv_blocks=64)
    sched.add_request(make_request("a", prompt_len=6, max_tokens=6))
    so = sched.schedule()
    sched.update_from_output(so, burst_output(so))  # 7 tokens known
    so = sched.schedule()
    assert so.num_decode_steps == 12 - 7  # up to max_model_len tokens in all
    outs = sched.update_from_output(so, burst_output(so))
    assert sched.requests.get("a") is None
    assert outs.outputs[0].finish_reason is not None


def test_no_burst_with_admissions_grammars_or_word_timestamps() -> None:
    sched = make_scheduler(num_scheduler_steps=4, num_kv_blocks=64)
    sched.add_request(make_request("a", prompt_len=3, max_tokens=20))
    so = sched.schedule()
    sched.update_from_output(so, burst_output(so))
    sched.add_request(make_request("late", prompt_len=3, max_tokens=20))
    so = sched.schedule()
    assert so.num_decode_steps == 1  # "late" is admitted in this step
    sched.update_from_output(so, burst_output(so))
    assert sched.schedule().num_decode_steps == 4
    for params in (
        {"word_timestamps": True},
        {"structured_outputs": StructuredOutputsParams(json_object=True), "ignore_eos": False},
    ):
        sched = make_scheduler(num_scheduler_steps=4, num_kv_blocks=64)
        request = make_request("w", prompt_len=3, max_tokens=20)
        request.sampling_params = replace(request.sampling_params, **params)
        sched.add_request(request)
        so = sched.schedule()
        sched.update_from_output(so, burst_output(so))
        assert sched.schedule().num_decode_steps == 1
        assert request.status == RequestStatus.RUNNING


def test_auto_bursts_skip_streamed_requests_a_users_value_bursts_them() -> None:
    """An auto num_scheduler_steps (EngineConfig.auto_num_scheduler_steps) bursts only while no
    scheduled request is streamed; a user's value bursts streamed requests too."""
    for auto, streamed, expected in (
        (True, (False, False), 4),
        (True, (False, True), 1),
        (False, (True, True), 4),
    ):
        sched = make_scheduler(num_scheduler_steps=4, num_kv_blocks=64)
        sched.bursts_take_streamed = not auto
        for i, flag in enumerate(streamed):
            request = make_request(f"r{i}", prompt_len=3, max_tokens=20)
            request.streamed = flag
            sched.add_request(request)
        so = sched.schedule()
        sched.update_from_output(so, burst_output(so))
        assert sched.schedule().num_decode_steps == expected, (auto, streamed)
