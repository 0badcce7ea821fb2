"""LLM.embed / classify / score / rerank on tiny random BERTs (and MiniLM when present)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from tests.utils import ASSETS, make_tiny_model_dir, make_tiny_wordpiece_tokenizer, needs_assets
from v1 import LLM, PoolingParams, SamplingParams
from v1.core.queue_depth import PoolingQueueDepth

pytest.importorskip("v1.models.bert")

TINY_BERT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
ENGINE_ARGS = dict(multiprocess=False, max_num_batched_tokens=256, max_num_seqs=4)
PAIRS = [
    ("the quick brown fox", "the lazy dog"),
    ("hello world", "a query document"),
    ("all that glitters is not gold", "gold"),
]


def _cross_encoder(path: Path, num_labels: int) -> str:
    make_tiny_wordpiece_tokenizer(path)
    return make_tiny_model_dir(
        BertConfig,
        BertForSequenceClassification,
        path,
        tokenizer_from=path,
        num_labels=num_labels,
        **TINY_BERT,
    )


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("scorer"), num_labels=1)


@pytest.fixture(scope="module")
def scorer(scorer_dir: str):
    with LLM(scorer_dir, **ENGINE_ARGS) as llm:
        yield llm


def _hf_logits(path: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    from transformers import AutoTokenizer

    model = BertForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.cat([model(**tokenizer(a, b, return_tensors="pt")).logits for a, b in pairs])


def test_cross_encoder_score_and_rerank(scorer: LLM, scorer_dir: str) -> None:
    expected = torch.sigmoid(_hf_logits(scorer_dir, PAIRS))[:, 0].tolist()
    outputs = scorer.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
    assert [o.outputs.score for o in outputs] == pytest.approx(expected, abs=1e-4)
    assert all(o.finished and o.error is None for o in outputs)
    query, docs = "the quick brown fox", ["the lazy dog", "hello world", "gold", "a query"]
    one_to_many = scorer.score(query, docs)
    expected = torch.sigmoid(_hf_logits(scorer_dir, [(query, d) for d in docs]))[:, 0].tolist()
    assert [o.outputs.score for o in one_to_many] == pytest.approx(expected, abs=1e-4)
    ranked = scorer.rerank(query, docs, top_n=3)
    order = sorted(range(len(docs)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in ranked] == order
    assert [r.document for r in ranked] == [docs[i] for i in order]
    assert ranked[0].relevance_score == pytest.approx(max(expected), abs=1e-4)


def test_classify(tmp_path: Path) -> None:
    path = _cross_encoder(tmp_path / "cls", num_labels=3)
    texts = ["the quick brown fox", "hello world"]
    with LLM(path, **ENGINE_ARGS) as llm:
        outputs = llm.classify(texts)
    for text, out in zip(texts, outputs, strict=True):
        logits = _single_logits(path, text)
        assert out.outputs.num_classes == 3
        assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-4)


def _single_logits(path: str, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    model = BertForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(**AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")).logits[0]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.generate("hello"), "encoder-only"),
        (lambda llm: llm.embed(""), "empty"),
        (lambda llm: llm.embed("the " * 100), "limit of 64"),
        (lambda llm: llm.score(["a", "b"], ["c", "d", "e"]), "one to one"),
        (lambda llm: llm.score([], "c"), "at least one"),
        (lambda llm: llm.rerank("q", []), "non-empty"),
        (lambda llm: llm.rerank("q", ["d"], top_n=0), "top_n"),
        (lambda llm: llm.embed(["a", "b"], [PoolingParams()] * 3), "entries for 2 prompts"),
        (lambda llm: llm.embed({"prompt_token_ids": [2, 10**6, 3]}), "vocabulary"),
    ],
)
def test_invalid_pooling_calls_raise(scorer: LLM, call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(scorer)
    assert not scorer.llm_engine.has_unfinished_requests()


def test_truncation_and_input_order(scorer: LLM) -> None:
    long_text = "the quick brown fox " * 40
    (clipped,) = scorer.embed(long_text, truncate_prompt_tokens=-1)
    assert len(clipped.prompt_token_ids) == 64 and clipped.prompt_token_ids[-1] == 3
    short = scorer.embed([long_text, "hello"], truncate_prompt_tokens=6)
    assert [len(o.prompt_token_ids) for o in short] == [6, 3]
    assert all(isinstance(v, float) for v in short[0].outputs.embedding)
    assert short[0].outputs.embedding != short[1].outputs.embedding
    # The float32 array the engine produced, the same values as the list.
    assert short[0].outputs.data.dtype == np.float32
    assert short[0].outputs.data.tolist() == short[0].outputs.embedding


def test_generator_rejects_pooling_calls(tiny_llama_dir: str) -> None:
    with LLM(tiny_llama_dir, multiprocess=False, num_kv_blocks=17) as llm:
        for call in (llm.embed, llm.classify):
            with pytest.raises(ValueError, match="generative"):
                call("hello")
        with pytest.raises(ValueError, match="SamplingParams"):
            llm.generate("hello", PoolingParams())
        assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@needs_assets(ASSETS / "all-MiniLM-L6-v2")
def test_minilm_embeddings_and_cosine_scores() -> None:
    """The reference values of ../shared/assets/README.md (sentence-transformers, fp32)."""
    with LLM(str(ASSETS / "all-MiniLM-L6-v2"), **ENGINE_ARGS) as llm:
        (emb,) = llm.embed("The new movie is awesome")
        assert emb.outputs.hidden_size == 384
        assert np.linalg.norm(emb.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
        scores = llm.score(
            "The new movie is awesome", ["The new movie is so great", "A monkey is playing drums."]
        )
        assert [s.outputs.score for s in scores] == pytest.approx([0.89392, -0.02990], abs=1e-4)
        ranked = llm.rerank(
            "The new movie is awesome", ["A monkey is playing drums.", "The new movie is so great"]
        )
        assert [r.index for r in ranked] == [1, 0]


@pytest.mark.parametrize("multiprocess", [False, True])
def test_async_scheduling_gives_the_same_results(scorer_dir: str, multiprocess: bool) -> None:
    """Pipelined steps (launch N+1, then read N) over many steps give the synchronous
    engine's results, in input order. The synchronous reference runs in this process in both
    cases (a core process of its own would only add start-up: every server drives that)."""
    texts = [" ".join(["the quick brown fox"] * (1 + i % 7)) for i in range(24)]
    args = dict(ENGINE_ARGS, max_num_batched_tokens=64)
    results = []
    for async_scheduling in (False, True):
        mp = dict(args, multiprocess=multiprocess and async_scheduling)
        with LLM(scorer_dir, async_scheduling=async_scheduling, **mp) as llm:
            embeds = llm.embed(texts)
            scores = llm.score(texts[0], texts)
            results.append(
                ([o.outputs.embedding for o in embeds], [s.outputs.score for s in scores])
            )
            assert llm.llm_engine.get_stats()["num_requests"] == 0
    # Equal up to float rounding: steps are composed differently when some run in flight.
    np.testing.assert_allclose(np.array(results[0][0]), np.array(results[1][0]), atol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], atol=1e-6)


# ---- a batch fed as the steps go ----
def _token_prompts(num: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token-id inputs of 3-64 tokens: some do not fit a step's remaining budget and are
    passed over for later ones that do."""
    rng = np.random.default_rng(seed)
    return [
        {"prompt_token_ids": [2, *rng.integers(5, 60, size=int(n) - 2).tolist(), 3]}
        for n in rng.integers(3, 65, size=num)
    ]


def _record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The request ids of each step the in-process core schedules from now on."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    steps: list[list[str]] = []

    def recording() -> Any:
        so = schedule()
        if so.total_num_scheduled_tokens:
            steps.append(list(so.num_scheduled_tokens))
        return so

    monkeypatch.setattr(scheduler, "schedule", recording)
    return steps


def _steps_by_input(steps: list[list[str]], outputs: list[Any]) -> list[list[tuple[int, int]]]:
    """Recorded steps as (first input, inputs) per core request: a packed one is named
    "<first input's id>+<inputs>" (`RequestFeed`)."""
    index = {o.request_id: i for i, o in enumerate(outputs)}
    by_input = []
    for step in steps:
        row = []
        for core_id in step:
            first, _, count = core_id.partition("+")
            row.append((index[first], int(count or 1)))
        by_input.append(row)
    return by_input


def embed_all_queued_first(
    llm: LLM, prompts: list[Any], monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """`llm.embed` with the whole batch processed and queued before the first step (the feed
    never finds the queue deep enough): the reference the fed batch must match."""
    with monkeypatch.context() as m:
        m.setattr(PoolingQueueDepth, "reached", lambda *_: False)
        return llm.embed(prompts, use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("max_num_seqs", "budget"), [(4, 64), (64, 256)])
def test_embed_runs_the_steps_of_the_whole_batch_queued(
    scorer_dir: str,
    async_scheduling: bool,
    max_num_seqs: int,
    budget: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`embed` adds its inputs as the steps need them, yet every step holds the requests it
    would hold with the whole batch queued at once, so the embeddings are those, to the bit
    (they are not under other step compositions: float sums in other orders), in input
    order. max_num_seqs=4: the feed is bounded by its number of requests, one input each;
    64: by tokens, inputs packed up to 8 (32 tokens) to a core request."""
    prompts = _token_prompts(100)
    args = dict(
        ENGINE_ARGS,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        async_scheduling=async_scheduling,
    )
    with LLM(scorer_dir, **args) as llm:
        steps = _record_steps(llm, monkeypatch)
        reference = embed_all_queued_first(llm, prompts, monkeypatch)
        ref_steps = _steps_by_input(steps, reference)
        steps.clear()
        outputs = llm.embed(prompts, use_tqdm=False)
        assert _steps_by_input(steps, outputs) == ref_steps
    # Many steps, some of which took later inputs past one that did not fit.
    inputs = [[i for first, n in s for i in range(first, first + n)] for s in ref_steps]
    assert len(ref_steps) > 10 and any(s != list(range(s[0], s[0] + len(s))) for s in inputs)
    packed = [count for s in ref_steps for _, count in s if count > 1]
    assert bool(packed) == (max_num_seqs == 64)
    for i, out in enumerate(outputs):
        assert out.request_id != reference[i].request_id
        assert out.prompt_token_ids == prompts[i]["prompt_token_ids"]
        np.testing.assert_array_equal(
            np.asarray(out.outputs.embedding), np.asarray(reference[i].outputs.embedding)
        )


def test_embed_starts_the_device_before_processing_the_whole_batch(
    scorer: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = scorer.llm_engine
    process = engine.process_request
    processed: list[int] = []
    monkeypatch.setattr(
        engine,
        "process_request",
        lambda *a, **k: processed.append(1) or process(*a, **k),
    )
    scheduler = engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    at_first_step: list[int] = []
    monkeypatch.setattr(
        scheduler, "schedule", lambda: at_first_step.append(len(processed)) or schedule()
    )
    prompts = _token_prompts(200, seed=1)
    outputs = scorer.embed(prompts, use_tqdm=False)
    assert len(processed) == len(prompts) and len(outputs) == len(prompts)
    # max_num_seqs=4: 4 + MAX_SKIPS_PER_STEP unfinished requests feed any step.
    assert 0 < at_first_step[0] <= 20


def test_invalid_prompt_in_a_pooling_batch_aborts_the_queued_ones(scorer: LLM) -> None:
    prompts = [*_token_prompts(40, seed=2), {"prompt_token_ids": [2, 10**6, 3]}]
    with pytest.raises(ValueError, match=r"prompt 40: .*vocabulary"):
        scorer.embed(prompts, use_tqdm=False)
    assert not scorer.llm_engine.has_unfinished_requests()
    stats = scorer.llm_engine.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    (ok,) = scorer.embed(prompts[:1], use_tqdm=False)
    assert ok.error is None and len(ok.outputs.embedding) == 32
    texts = ["the quick brown fox"] * 100
    texts[70] = ""  # in the second chunk of texts tokenized together
    with pytest.raises(ValueError, match=r"prompt 70: .*empty"):
        scorer.embed(texts, use_tqdm=False)
    assert not scorer.llm_engine.has_unfinished_requests()


def test_per_prompt_pooling_params_stay_per_prompt(scorer: LLM) -> None:
    """A batch shares one clone of a shared params object; distinct ones keep their options."""
    raw, unit = PoolingParams(normalize=False), PoolingParams()
    texts = ["the quick brown fox", "hello world", "gold"]
    outputs = scorer.embed(texts, [raw, unit, raw], use_tqdm=False)
    norms = [np.linalg.norm(o.outputs.embedding) for o in outputs]
    assert norms[1] == pytest.approx(1.0, abs=1e-5)
    assert abs(norms[0] - 1.0) > 1e-3 and abs(norms[2] - 1.0) > 1e-3
    shared = scorer.embed(texts, unit, use_tqdm=False)
    assert [o.outputs.embedding for o in shared][1] == outputs[1].outputs.embedding
    assert raw.task == "embed" and raw.truncate_prompt_tokens is None  # the caller's untouched
    clipped = scorer.embed(texts, raw, truncate_prompt_tokens=2, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in clipped] == [2, 2, 2]
    assert raw.truncate_prompt_tokens is None


# ---- many steps of mixed inputs ----
def test_mixed_batches_give_each_input_its_own_result(scorer: LLM) -> None:
    """Embed (mixed normalize), classify (mixed activation) and score (text pairs: segment
    ids) batches of mixed lengths over many steps, slots reused from step to step: each
    result is what its input gets alone, and every request and slot is freed afterwards."""
    prompts = _token_prompts(40, seed=4)
    embed_params = [PoolingParams(normalize=i % 3 != 0) for i in range(len(prompts))]
    classify_params = [PoolingParams(task="classify", activation=i % 2 == 0) for i in range(16)]
    docs = [" ".join(["the quick brown fox"] * (1 + i % 9)) for i in range(16)]

    def run(n: int) -> list[list[float]]:
        """Results in `n`-input calls (n=1: each input alone)."""
        out = []
        for i in range(0, len(prompts), n):
            batch = scorer.embed(prompts[i : i + n], embed_params[i : i + n], use_tqdm=False)
            out += [o.outputs.embedding for o in batch]
        for i in range(0, len(docs), n):
            batch = scorer.classify(docs[i : i + n], classify_params[i : i + n], use_tqdm=False)
            out += [o.outputs.probs for o in batch]
        for i in range(0, len(docs), n):
            out += [[o.outputs.score] for o in scorer.score("gold", docs[i : i + n])]
        return out

    together, alone = run(len(prompts)), run(1)
    assert len(together) == len(alone) == len(prompts) + 2 * len(docs)
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert together[0] != together[1]  # inputs of their own
    core = scorer.llm_engine.engine_core.engine_core
    assert not core.scheduler.requests and not core.scheduler.running
    core.step()  # the runner drops the last step's requests with the next step
    batch = core.executor.worker.model_runner.input_batch
    assert len(batch) == 0 and len(batch._free_slots) == batch.max_num_reqs
    assert not batch.num_tokens.any()
