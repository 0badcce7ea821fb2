"""Held requests and forks in the scheduler: a finished `hold_kv` request keeps its blocks, the
requests naming it in `fork_from` compute one token on them, and every block comes back after
last forks, aborts, mismatches, evictions under KV pressure and id reuse."""

from __future__ import annotations

from tests.core.fakes import FakeRunner, make_request, make_scheduler, run_scheduler_step
from v1.core.request import Request, RequestStatus

PROMPT = list(range(3, 9))  # 6 tokens: one full block of 4 and a partial one


def beam_step(
    req_id: str,
    tokens: list[int],
    fork_from: str | None = None,
    last_fork: bool = False,
    prompt: list[int] = PROMPT,
) -> Request:
    """A beam step request: `prompt` + `tokens` so far, one more token wanted, KV held after."""
    request = make_request(req_id, max_tokens=len(tokens) + 1, prompt=list(prompt))
    request.append_output_token_ids(list(tokens))
    request.hold_kv, request.fork_from, request.last_fork = True, fork_from, last_fork
    return request


def hold_root(sched, runner) -> list[int]:
    """Runs the first step request to its end; returns its (held) block ids."""
    sched.add_request(beam_step("root", []))
    so, out = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"root": 6}
    assert out.outputs[0].finish_reason is not None
    assert "root" in sched.forks and "root" not in sched.requests
    assert "root" in sched.finished_req_ids  # the runner drops it; the blocks stay
    (blocks,) = sched.kv_cache_manager.get_block_ids("root")
    return blocks


def assert_all_free(sched) -> None:
    kv = sched.kv_cache_manager
    assert not sched.forks.held and not sched.forks._forks
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert not sched.requests and not sched.running and len(sched.waiting) == 0


def run_all(sched, runner) -> list:
    steps = []
    while sched.has_requests():
        steps.append(run_scheduler_step(sched, runner))
    return steps


def test_forks_compute_one_token_and_copy_the_partial_block_once() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64), FakeRunner()
    root_blocks = hold_root(sched, runner)
    sched.add_request(beam_step("a", [20], fork_from="root"))
    sched.add_request(beam_step("b", [21], fork_from="root", last_fork=True))
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [6, 6]
    a_blocks, b_blocks = (r.block_ids[0] for r in so.scheduled_new_reqs)
    # b, the last fork, took the root's partial block; a got a copy of it.
    assert b_blocks == root_blocks and a_blocks[0] == root_blocks[0]
    assert so.block_copies == [(root_blocks[1], a_blocks[1])]
    assert "root" not in sched.forks  # released by its last fork
    stats = sched.make_stats()
    assert (stats.num_forks, stats.num_forked_tokens, stats.num_block_copies) == (2, 12, 1)
    # Both held now; the next step forks from a only (b has no continuation: released).
    sched.add_request(beam_step("a2", [20, 30], fork_from="a", last_fork=True))
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"a2": 1} and so.block_copies == []
    sched.finish_requests(["a2"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_a_release_waits_for_the_forks_already_registered() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64), FakeRunner()
    root_blocks = hold_root(sched, runner)
    sched.add_request(beam_step("a", [20], fork_from="root"))
    sched.finish_requests(["root"], RequestStatus.FINISHED_ABORTED)  # released, a still waits
    assert "root" in sched.forks
    so, _ = run_scheduler_step(sched, runner)
    # a was its last fork: it took the partial block over, and the root is gone.
    assert so.num_scheduled_tokens == {"a": 1} and so.block_copies == []
    assert so.scheduled_new_reqs[0].block_ids[0] == root_blocks
    assert "root" not in sched.forks
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_aborting_the_waiting_forks_frees_a_released_parent() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64), FakeRunner()
    hold_root(sched, runner)
    sched.add_request(beam_step("a", [20], fork_from="root"))
    sched.add_request(beam_step("b", [21], fork_from="root", last_fork=True))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert "root" in sched.forks
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_a_fork_whose_tokens_differ_computes_them() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64), FakeRunner()
    hold_root(sched, runner)
    other = beam_step("x", [20], fork_from="root", last_fork=True)
    other.all_token_ids[2] = 99  # not the root's sequence
    sched.add_request(other)
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"x": 7} and sched.kv_cache_manager.num_forks == 0
    assert "root" not in sched.forks  # its last fork released it all the same
    run_all(sched, runner)
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_kv_pressure_frees_held_requests_before_preempting() -> None:
    """Held requests are cache: a running request that needs a block frees them rather than
    preempting anyone, and a fork whose parent went computes its tokens again."""
    # 8 usable blocks: root (6 tokens) holds 2, "long" fills the other 6 as it decodes.
    sched, runner = make_scheduler(num_kv_blocks=9), FakeRunner()
    hold_root(sched, runner)
    sched.add_request(make_request("long", prompt_len=20, max_tokens=8))
    run_all(sched, runner)
    assert sched.num_preemptions == 0 and "root" not in sched.forks
    assert sched.kv_cache_manager.num_requests == 0
    sched.add_request(beam_step("a", [20], fork_from="root", last_fork=True))
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens["a"] == 7 - 4  # the root's full block stayed cached
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_a_fork_short_of_blocks_evicts_other_held_requests() -> None:
    # 4 usable blocks: two held requests of 2 blocks each fill them.
    sched, runner = make_scheduler(num_kv_blocks=5), FakeRunner()
    hold_root(sched, runner)
    other_prompt = list(range(40, 46))
    sched.add_request(beam_step("other", [], prompt=other_prompt))
    run_scheduler_step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 0 and len(sched.forks) == 2
    # Forking "other" needs a block for the copy of its partial block: the oldest held
    # request (root) is freed for it.
    sched.add_request(beam_step("a", [20], fork_from="other", prompt=other_prompt))
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1} and len(so.block_copies) == 1
    assert "root" not in sched.forks and "other" in sched.forks
    sched.finish_requests(["a", "other"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_a_new_request_with_a_held_id_replaces_it() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64), FakeRunner()
    hold_root(sched, runner)
    sched.add_request(make_request("root", prompt_len=3, max_tokens=1))
    assert "root" not in sched.forks
    run_all(sched, runner)
    assert_all_free(sched)


def test_forks_work_without_prefix_caching() -> None:
    sched, runner = make_scheduler(num_kv_blocks=64, enable_prefix_caching=False), FakeRunner()
    hold_root(sched, runner)
    sched.add_request(beam_step("a", [20], fork_from="root", last_fork=True))
    so, _ = run_scheduler_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)


def test_engine_core_releases_the_parent_of_a_rejected_last_fork() -> None:
    """Through EngineCore.add_request: a last fork that fails admission (a bad token) still
    ends its parent's hold; an ABORT of a held request releases it."""
    from tests.core.fakes import make_engine_core
    from v1.core.protocol import EngineCoreRequest
    from v1.sampling_params import SamplingParams

    core = make_engine_core()

    def step_request(req_id: str, tokens: list[int], **fork) -> EngineCoreRequest:
        params = SamplingParams(max_tokens=len(tokens) + 1, ignore_eos=True)
        return EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=list(PROMPT),
            sampling_params=params,
            output_token_ids=tokens or None,
            hold_kv=True,
            **fork,
        )

    def run() -> list:
        outputs = []
        while core.has_work():
            outputs += core.step().outputs
        return outputs

    core.add_request(step_request("p", []))
    core.add_request(step_request("q", []))
    run()
    kv = core.scheduler.kv_cache_manager
    assert sorted(core.scheduler.forks.held) == ["p", "q"] and kv.num_requests == 2
    core.add_request(step_request("bad", [10**6], fork_from="p", last_fork=True))
    (out,) = run()
    assert out.request_id == "bad" and out.error is not None
    assert sorted(core.scheduler.forks.held) == ["q"]
    core.abort_requests(["q"])
    assert not core.scheduler.forks.held and kv.num_requests == 0
    assert kv.num_free_blocks == kv.num_total_blocks
