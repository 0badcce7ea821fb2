"""Full cyclic-GC collections are deferred while an offline batch loop steps the engine, and
Python's thresholds come back afterwards (also after an error and in nested loops); offline
pooling batches step with automatic collections paused (a young collection every N steps)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests.utils import make_tiny_llama_dir
from v1 import LLM, SamplingParams, gc_policy
from v1.gc_policy import FULL_COLLECTION_FACTOR, deferred_full_collections, paused_collections


def test_deferred_full_collections_nest_and_restore() -> None:
    before = gc.get_threshold()
    with deferred_full_collections():
        raised = gc.get_threshold()
        assert raised == (before[0], before[1], before[2] * FULL_COLLECTION_FACTOR)
        with deferred_full_collections():
            assert gc.get_threshold() == raised  # not raised twice
        assert gc.get_threshold() == raised
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), deferred_full_collections():
        raise RuntimeError("a failed batch")
    assert gc.get_threshold() == before


def test_llm_generate_steps_with_full_collections_deferred(tmp_path: Any) -> None:
    before = gc.get_threshold()
    with LLM(make_tiny_llama_dir(tmp_path / "llama"), multiprocess=False) as llm:
        seen = []
        step = llm.llm_engine.step

        def recording_step() -> Any:
            seen.append(gc.get_threshold())
            return step()

        llm.llm_engine.step = recording_step  # type: ignore[method-assign]
        outs = llm.generate(["a b c", "d e"], SamplingParams(max_tokens=3, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert seen and set(seen) == {(before[0], before[1], before[2] * FULL_COLLECTION_FACTOR)}
    assert gc.get_threshold() == before


def test_paused_collections_tick_collects_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused: automatic collections off, one generation-1 collection every
    PAUSED_COLLECTION_STEPS ticks; enabled again after (also after an error); a collector
    that was off stays off."""
    collected: list[int] = []
    monkeypatch.setattr(gc_policy, "PAUSED_COLLECTION_STEPS", 3)
    monkeypatch.setattr(gc_policy.gc, "collect", lambda generation=2: collected.append(generation))
    assert gc.isenabled()
    with paused_collections() as tick:
        assert not gc.isenabled()
        for _ in range(7):
            tick()
    assert collected == [1, 1] and gc.isenabled()
    with pytest.raises(RuntimeError), paused_collections():
        raise RuntimeError("a failed batch")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collections():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_llm_embed_steps_with_collections_paused_generate_without(tmp_path: Any) -> None:
    """An offline pooling batch steps with automatic collections paused; generation keeps
    them (only full collections deferred); both leave the collector on."""
    from tests.entrypoints.test_llm_pooling import _cross_encoder

    seen: list[bool] = []

    def record(llm: LLM) -> None:
        step = llm.llm_engine.step

        def recording_step() -> Any:
            seen.append(gc.isenabled())
            return step()

        llm.llm_engine.step = recording_step  # type: ignore[method-assign]

    with LLM(_cross_encoder(tmp_path / "bert", num_labels=1), multiprocess=False) as llm:
        record(llm)
        out = llm.embed(["a b", "c d e"], use_tqdm=False)
    assert len(out) == 2 and seen and not any(seen) and gc.isenabled()
    seen.clear()
    with LLM(make_tiny_llama_dir(tmp_path / "llama"), multiprocess=False) as llm:
        record(llm)
        llm.generate(["a b c"], SamplingParams(max_tokens=2, temperature=0))
    assert seen and all(seen) and gc.isenabled()
