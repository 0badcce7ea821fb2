"""Three pooling steps in flight: encoder-only models on a GPU default to max_steps_in_flight=3
(`resolve_max_steps_in_flight`), so a slow host step finds a second step queued on the device;
the batch fed as the steps go still runs the steps of the whole batch queued (to the bit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.entrypoints.test_llm_pooling import _cross_encoder, _record_steps, _token_prompts
from tests.utils import WHISPER_BASE, make_tiny_llama_dir
from v1 import LLM, PoolingParams
from v1.config import (
    AUTO_MAX_NUM_SEQS_POOLING,
    AUTO_POOLING_BATCHED_TOKENS,
    POOLING_STEPS_IN_FLIGHT,
    EngineConfig,
    make_engine_config,
)


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("scorer"), num_labels=1)


def _depth(config: EngineConfig) -> int | None:
    return config.scheduler_config.max_steps_in_flight


def test_pooling_models_on_gpu_default_to_three_steps(scorer_dir: str, tmp_path: Path) -> None:
    gpu = make_engine_config(scorer_dir, device="cuda", offline=True)
    assert _depth(gpu) == POOLING_STEPS_IN_FLIGHT == 3
    assert _depth(EngineConfig.from_json(gpu.to_json())) == 3  # resolved once, an int
    assert _depth(make_engine_config(scorer_dir, device="cuda")) == 3  # the server too
    assert _depth(make_engine_config(scorer_dir, device="cpu")) == 2
    assert _depth(make_engine_config(scorer_dir, device="cuda", max_steps_in_flight=2)) == 2
    llama = make_tiny_llama_dir(tmp_path / "llama")
    assert _depth(make_engine_config(llama, device="cuda", offline=True)) == 2
    if WHISPER_BASE.is_dir():
        from tests.utils import make_tiny_whisper_dir

        whisper = make_tiny_whisper_dir(tmp_path / "whisper")
        assert _depth(make_engine_config(whisper, device="cuda", offline=True)) == 2
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        make_engine_config(scorer_dir, max_steps_in_flight=5)


def test_pooling_models_on_gpu_default_to_the_tuned_batch(scorer_dir: str, tmp_path: Path) -> None:
    """An encoder-only model on a GPU runs steps of 32,768 tokens and up to 512 inputs unless
    told otherwise (the tuned BERT rows' settings); elsewhere 4,096 tokens and 128 requests.
    Resolved once: a config crossing processes carries the ints."""

    def budget(config: EngineConfig) -> tuple[int | None, int | None]:
        sc = config.scheduler_config
        return sc.max_num_batched_tokens, sc.max_num_seqs

    gpu = make_engine_config(scorer_dir, device="cuda", offline=True)
    assert budget(gpu) == (AUTO_POOLING_BATCHED_TOKENS, AUTO_MAX_NUM_SEQS_POOLING) == (32768, 512)
    assert budget(EngineConfig.from_json(gpu.to_json())) == (32768, 512)
    assert budget(make_engine_config(scorer_dir, device="cuda")) == (32768, 512)  # the server
    assert budget(make_engine_config(scorer_dir, device="cpu")) == (4096, 128)
    mine = make_engine_config(
        scorer_dir, device="cuda", max_num_batched_tokens=2048, max_num_seqs=64
    )
    assert budget(mine) == (2048, 64)
    llama = make_tiny_llama_dir(tmp_path / "llama")
    assert budget(make_engine_config(llama, device="cuda", offline=True))[0] == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        make_engine_config(scorer_dir, max_num_batched_tokens=0)


def _three_in_flight(max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, Any]:
    """An engine in this process with three pooling steps in flight (pipelined on CPU)."""
    return dict(
        multiprocess=False,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        async_scheduling=True,
        max_steps_in_flight=3,
    )


def test_three_steps_in_flight_embed_the_whole_batch_queued(
    scorer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Depth 3 on CPU (pipelined on request): the feed keeps enough requests queued for the
    two steps in flight, so every step holds what it holds with the whole batch queued, and
    the embeddings are those, to the bit, in input order; nothing is left in the core."""
    prompts = _token_prompts(60, seed=3)
    with LLM(scorer_dir, **_three_in_flight(64, 8)) as llm:
        engine = llm.llm_engine
        assert engine.engine_core.engine_core.max_steps_in_flight == 3
        steps = _record_steps(llm, monkeypatch)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"ref-{i}", prompt, PoolingParams(task="embed"))
        reference: dict[int, np.ndarray] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                reference[int(out.request_id.removeprefix("ref-"))] = out.outputs.data
        ref_steps = [[int(r.removeprefix("ref-")) for r in step] for step in steps]
        steps.clear()
        outputs = llm.embed(prompts, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outputs)}
        assert [[index[r] for r in step] for step in steps] == ref_steps
        assert llm.llm_engine.get_stats()["num_requests"] == 0
    assert len(ref_steps) > 10
    for i, out in enumerate(outputs):
        assert out.prompt_token_ids == prompts[i]["prompt_token_ids"]
        np.testing.assert_array_equal(np.asarray(out.outputs.embedding), reference[i])


def test_the_first_pooling_step_starts_on_one_budget_of_the_batch(
    scorer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process the feed adds, before the first step, only what that step's scheduling
    needs (no step is in flight yet), not the full pipeline's three budgets, so the device
    starts sooner; the steps, hence the embeddings to the bit, are those of the full depth
    (which a core in its own process, running ahead of the feed, still gets)."""
    prompts = _token_prompts(120, seed=4)
    with LLM(scorer_dir, **_three_in_flight(256, 64)) as llm:
        engine = llm.llm_engine
        added: list[int] = []  # tokens of each input the core was given
        add_packed, add_processed = engine.add_packed_request, engine.add_processed_request

        def packed(request_id: str, inputs: list[Any], *args: Any, **kwargs: Any) -> None:
            added.extend(len(ids) for _, ids, _ in inputs)
            add_packed(request_id, inputs, *args, **kwargs)

        def processed(req_id: str, prompt: Any, params: Any, core_requests: list[Any]) -> None:
            added.extend(len(r.prompt_token_ids) for r in core_requests)
            add_processed(req_id, prompt, params, core_requests)

        monkeypatch.setattr(engine, "add_packed_request", packed)
        monkeypatch.setattr(engine, "add_processed_request", processed)
        scheduler = engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        at_schedule: list[int] = []
        monkeypatch.setattr(
            scheduler, "schedule", lambda: at_schedule.append(sum(added)) or schedule()
        )
        ramped = llm.embed(prompts, use_tqdm=False)
        ramped_first = at_schedule[0]
        at_schedule.clear()
        added.clear()
        with monkeypatch.context() as m:
            m.setattr(type(engine), "core_runs_ahead", property(lambda self: True))
            full = llm.embed(prompts, use_tqdm=False)
        full_first = at_schedule[0]
    # Three budgets less one and two: 2 * 256 tokens fewer before the first step, give or
    # take the input that crosses the line.
    assert ramped_first >= 256 and ramped_first + 2 * 256 - 64 <= full_first
    for a, b in zip(ramped, full, strict=True):
        assert a.outputs.embedding == b.outputs.embedding


def test_embeddings_are_converted_as_their_steps_finish(
    scorer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`embed` turns each output into its EmbeddingRequestOutput (float lists) when it
    arrives, between engine steps (so on a GPU while later steps run), not all after the
    last step; the results are those of the unconverted outputs, in input order."""
    from v1.entrypoints import llm as llm_mod
    from v1.outputs import EmbeddingRequestOutput

    events: list[str] = []
    original = EmbeddingRequestOutput.from_base

    def recording_convert(output):
        events.append("convert")
        return original(output)

    prompts = _token_prompts(40, seed=5)
    with LLM(scorer_dir, multiprocess=False, max_num_batched_tokens=64, max_num_seqs=8) as llm:
        engine = llm.llm_engine
        step = engine.step

        def recording_step():
            events.append("step")
            return step()

        monkeypatch.setattr(engine, "step", recording_step)
        monkeypatch.setattr(
            llm_mod.EmbeddingRequestOutput, "from_base", staticmethod(recording_convert)
        )
        outputs = llm.embed(prompts, use_tqdm=False)
        monkeypatch.undo()
        for i, prompt in enumerate(prompts):  # the reference: raw pooling outputs
            engine.add_request(f"ref-{i}", prompt, PoolingParams(task="embed"))
        reference: dict[int, np.ndarray] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                reference[int(out.request_id.removeprefix("ref-"))] = out.outputs.data
    assert events.count("convert") == len(prompts)
    assert "step" in events[events.index("convert") :]  # converting began before the last step
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outputs)
    for i, out in enumerate(outputs):
        assert isinstance(out.outputs.embedding, list)
        np.testing.assert_array_equal(np.asarray(out.outputs.embedding), reference[i])
