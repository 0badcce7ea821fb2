"""Beam search forks decoder KV in the engine (through `LLM.beam_search`, tiny random Llama and
BART): after the first step every beam computes exactly one token per step, beams that diverge
inside a block get one copied block each, and every block is free at the end: after a normal
end, a search that fails midway, and preemption under a tiny KV cache."""

from __future__ import annotations

from typing import Any

import pytest

from tests.entrypoints.test_llm_beam_search import ENGINE_ARGS, MAX_TOKENS, MODELS, TEXTS
from tests.utils import ONE_TORCH_THREAD
from v1 import LLM, BeamSearchParams, SamplingParams

pytestmark = ONE_TORCH_THREAD

PARAMS = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, num_return_sequences=4)


@pytest.fixture(scope="module", params=["llama", "bart"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, model folder)."""
    make, _ = MODELS[request.param]
    return request.param, make(tmp_path_factory.mktemp(request.param))


TINY_CACHE = {
    # (engine overrides, long generations beside the search): a cache that fits one request
    # of max_model_len (cross blocks included) but not the search and the generations.
    # max_num_seqs explicit: an auto value is lowered to what the tiny cache holds.
    "llama": ({"num_kv_blocks": 24, "max_num_seqs": 16}, 2),
    "bart": ({"num_kv_blocks": 28, "max_model_len": 32, "max_num_seqs": 16}, 3),
}


class StepProbe:
    """Records what every step of an in-process LLM's core computed."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.engine_core.engine_core
        self.scheduled: list[dict[str, int]] = []
        self.copies: list[tuple[int, int]] = []
        execute = self.core.executor.execute_model

        def recorded(so: Any) -> Any:
            self.scheduled.append(dict(so.num_scheduled_tokens))
            self.copies += so.block_copies
            return execute(so)

        self.core.executor.execute_model = recorded

    def tokens_per_request(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for step in self.scheduled:
            for req_id, n in step.items():
                out.setdefault(req_id, []).append(n)
        return out

    def assert_all_free(self) -> None:
        stats = self.core.get_stats()
        assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0, stats
        assert stats["num_used_blocks"] == 0 and not self.core.scheduler.forks.held


def results(outputs: list) -> list[list[tuple[list[int], float]]]:
    return [[(s.token_ids, s.score) for s in out.sequences] for out in outputs]


def test_beams_compute_one_token_per_step_and_copy_diverging_blocks(model) -> None:
    _, model_dir = model
    with LLM(model_dir, **ENGINE_ARGS) as llm:
        probe = StepProbe(llm)
        outputs = llm.beam_search(TEXTS, PARAMS)
        stats = probe.core.get_stats()
        per_request = probe.tokens_per_request()
        first = {r: n for r, n in per_request.items() if "-beam0." in r}
        later = {r: n for r, n in per_request.items() if "-beam0." not in r}
        assert len(first) == len(TEXTS) and len(later) > 4 * len(TEXTS)
        # The first step prefills the prompt; every later beam step computes its one new
        # token on its parent's KV (before forking, it recomputed the partial block).
        assert all(n == [1] for n in later.values()), later
        assert stats["num_forks"] == len(later)
        # Block size 4: beams diverge inside blocks, each diverging sibling copies one block.
        assert stats["num_block_copies"] == len(probe.copies) > 0
        assert len({dst for _, dst in probe.copies}) == len(probe.copies)
        probe.assert_all_free()
        expected = results(outputs)

    # Pipelined steps (the CUDA default) and no prefix caching fork the same beams.
    for overrides in ({"async_scheduling": True}, {"enable_prefix_caching": False}):
        with LLM(model_dir, **ENGINE_ARGS, **overrides) as llm:
            probe = StepProbe(llm)
            got = results(llm.beam_search(TEXTS, PARAMS))
            assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in expected]
            for r, e in zip(got, expected, strict=True):
                assert [s for _, s in r] == pytest.approx([s for _, s in e], abs=1e-5)
            assert probe.core.get_stats()["num_block_copies"] > 0
            probe.assert_all_free()


def test_a_search_that_fails_midway_frees_everything(model) -> None:
    _, model_dir = model
    with LLM(model_dir, **ENGINE_ARGS) as llm:
        probe = StepProbe(llm)
        expected = results(llm.beam_search(TEXTS, PARAMS))
        engine = llm.llm_engine
        step = engine.step
        calls = 0

        def failing_step() -> Any:
            nonlocal calls
            calls += 1
            if calls == 6:  # mid-search: some beams held, some in flight
                raise KeyboardInterrupt
            return step()

        engine.step = failing_step
        with pytest.raises(KeyboardInterrupt):
            llm.beam_search(TEXTS, PARAMS)
        engine.step = step
        assert probe.core.get_stats()["num_forks"] > 0
        engine.step()  # the aborts reach the core
        probe.assert_all_free()
        assert results(llm.beam_search(TEXTS, PARAMS)) == expected


def test_preemption_under_a_tiny_kv_cache_gives_the_same_beams(model) -> None:
    name, model_dir = model
    """Long generations beside the search in a tiny cache: held beams are freed for room,
    forked beam steps in flight are preempted (pipelined steps keep them running while the
    next step is scheduled) and recompute; the beams come out the same, nothing leaks."""
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir, **ENGINE_ARGS) as llm:
        expected = results(llm.beam_search(TEXTS, params))
    overrides, num_long = TINY_CACHE[name]
    args = {**ENGINE_ARGS, **overrides, "async_scheduling": True}
    with LLM(model_dir, **args) as llm:
        probe = StepProbe(llm)
        scheduler = probe.core.scheduler
        preempted: list[str] = []
        preempt = scheduler._preempt

        def recorded(request: Any) -> None:
            preempted.append(request.request_id)
            preempt(request)

        scheduler._preempt = recorded
        engine = llm.llm_engine
        long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for i in range(num_long):
            engine.add_request(f"long{i}", f"hello there {i}", long)
        got = results(llm.beam_search(TEXTS, params))
        while engine.has_unfinished_requests():  # the generations may outlast the search
            engine.step()
        stats = probe.core.get_stats()
        assert stats["num_held_evictions"] > 0 and stats["num_forks"] > 0
        assert any("-beam" in r for r in preempted), preempted
        probe.assert_all_free()
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in expected]
    for r, e in zip(got, expected, strict=True):
        assert [s for _, s in r] == pytest.approx([s for _, s in e], abs=1e-5)
