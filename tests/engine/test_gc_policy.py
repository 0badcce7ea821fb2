"""Full cyclic-GC collections are deferred while an offline batch loop steps the engine, and
Python's thresholds come back afterwards (also after an error and in nested loops)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests.utils import make_tiny_llama_dir
from v1 import LLM, SamplingParams
from v1.gc_policy import FULL_COLLECTION_FACTOR, deferred_full_collections


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
