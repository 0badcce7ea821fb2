"""Packed pooling requests: several encoder-only inputs in one core request
(`EngineCoreRequest.input_lens`), each run and pooled apart. `LLM.embed` / `classify` / `score`
pack the inputs of a batch; a custom frontend may send packs over the protocol itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.entrypoints.test_llm_pooling import _cross_encoder, _record_steps, _token_prompts
from v1 import LLM, PoolingParams
from v1.config import pooling_pack_limits, pooling_row_tokens
from v1.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.engine.output_processor import OutputProcessor

pytest.importorskip("v1.models.bert")

# max_num_seqs=64: packs of up to 8 inputs (POOLING_PACK_SHARE); 32 tokens a pack.
PACKING = dict(multiprocess=False, max_num_batched_tokens=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("classifier"), num_labels=3)


@pytest.fixture(scope="module")
def packer(classifier_dir: str):
    with LLM(classifier_dir, **PACKING) as llm:
        yield llm


def _core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _alone(llm: LLM, prompts: list[Any], task: str = "embed") -> list[np.ndarray]:
    """Each input's result in a call of its own (nothing packed)."""
    results = []
    for p in prompts:
        if task == "embed":
            results.append(np.asarray(llm.embed([p], use_tqdm=False)[0].outputs.data))
        else:
            results.append(np.asarray(llm.classify([p], use_tqdm=False)[0].outputs.probs))
    return results


def _run_core(llm: LLM, requests: list[EngineCoreRequest]) -> dict[str, EngineCoreOutput]:
    """Sends core requests as a custom frontend would and steps until each has its output."""
    core = _core(llm)
    for r in requests:
        core.add_request(r)
    outputs: dict[str, EngineCoreOutput] = {}
    for _ in range(200):
        if len(outputs) == len(requests):
            break
        for out in llm.llm_engine.engine_core.get_output().outputs:
            outputs[out.request_id] = out
    return outputs


def test_config_packs_offline_pooling_batches(classifier_dir: str) -> None:
    llm_config = LLM(classifier_dir, **PACKING).config
    assert pooling_pack_limits(llm_config) == (32, 8)
    assert pooling_row_tokens(llm_config) == 256  # max(model limit 64, min(256, 2048))


@pytest.mark.parametrize("multiprocess", [False, True])
def test_embed_packs_inputs_and_gives_each_its_own_result(
    classifier_dir: str, multiprocess: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of short inputs reaches the core as far fewer requests than inputs (packs of up
    to 8 / 32 tokens), and every input gets the result it gets alone, in input order, under
    its own request id. Over the wire too (multiprocess)."""
    prompts = _token_prompts(48, seed=7)
    for p in prompts:  # 3-6 tokens: several fit a 32-token pack
        p["prompt_token_ids"] = p["prompt_token_ids"][:6]
    with LLM(classifier_dir, **{**PACKING, "multiprocess": multiprocess}) as llm:
        seen: list[EngineCoreRequest] = []
        client = llm.llm_engine.engine_core
        add = client.add_request
        monkeypatch.setattr(client, "add_request", lambda r: seen.append(r) or add(r))
        outputs = llm.embed(prompts, use_tqdm=False)
        monkeypatch.undo()
        alone = _alone(llm, prompts)
        assert not llm.llm_engine.has_unfinished_requests()
    packs = [r for r in seen if r.input_lens is not None]
    assert packs and len(seen) < len(prompts) // 3
    assert all(len(r.input_lens) <= 8 and len(r.prompt_token_ids) <= 32 for r in packs)
    assert sum(len(r.input_lens or [0]) for r in seen) == len(prompts)
    assert len({o.request_id for o in outputs}) == len(prompts)
    for out, prompt, ref in zip(outputs, prompts, alone, strict=True):
        assert out.error is None and out.finished
        assert out.prompt_token_ids == prompt["prompt_token_ids"]
        np.testing.assert_allclose(out.outputs.data, ref, rtol=0, atol=2e-6)


def test_classify_packs_texts_and_text_pairs_with_their_segment_ids(
    packer: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = ["gold", "the quick brown fox", "hello world", "a b c", "dog"] * 3
    together = packer.classify(texts, use_tqdm=False)
    for out, ref in zip(together, _alone(packer, texts, "classify"), strict=True):
        np.testing.assert_allclose(out.outputs.probs, ref, rtol=0, atol=2e-6)
    seen: list[EngineCoreRequest] = []
    client = packer.llm_engine.engine_core
    add = client.add_request
    monkeypatch.setattr(client, "add_request", lambda r: seen.append(r) or add(r))
    pairs = [{"text": "gold", "text_pair": t} for t in texts]
    packed = packer.classify(pairs, use_tqdm=False)
    monkeypatch.undo()
    for out, ref in zip(packed, _alone(packer, pairs, "classify"), strict=True):
        np.testing.assert_allclose(out.outputs.probs, ref, rtol=0, atol=2e-6)
    # Each pack carries its inputs' segment ids back to back: 0s for "[CLS] gold [SEP]", 1s
    # for the second text.
    tokenizer = packer.get_tokenizer()
    sent = [t for r in seen for t in (r.token_type_ids or [])]
    expected = [t for p in pairs for t in tokenizer(p["text"], p["text_pair"])["token_type_ids"]]
    assert any(r.input_lens for r in seen) and sent == expected and 1 in sent


def test_a_pack_holds_consecutive_inputs_of_equal_params(
    packer: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-input params split the packs where they change; each input keeps its options."""
    seen: list[EngineCoreRequest] = []
    client = packer.llm_engine.engine_core
    add = client.add_request
    monkeypatch.setattr(client, "add_request", lambda r: seen.append(r) or add(r))
    raw, unit = PoolingParams(normalize=False), PoolingParams()
    texts = ["gold", "dog", "a b c", "hello world", "the quick brown fox", "dog"]
    params = [raw, raw, unit, unit, unit, raw]
    outputs = packer.embed(texts, params, use_tqdm=False)
    monkeypatch.undo()
    assert [len(r.input_lens) for r in seen] == [2, 3, 1]
    norms = [np.linalg.norm(o.outputs.embedding) for o in outputs]
    assert [abs(n - 1.0) < 1e-5 for n in norms] == [p is unit for p in params]
    for out, text, p in zip(outputs, texts, params, strict=True):
        (ref,) = packer.embed([text], p, use_tqdm=False)
        np.testing.assert_allclose(out.outputs.data, ref.outputs.data, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([2, 10**6, 3], "vocabulary"),
        ([2, 5.0, 3], "must be ints"),
        ([True, False], "must be ints"),
        ([2, True, 3], "must be ints"),  # packed among ints: an int array would take it as 1
        ([2, [5], 3], "must be ints"),
        ([2, -1, 3], "vocabulary"),
    ],
)
def test_bad_token_ids_in_a_packed_batch_name_their_prompt(
    packer: LLM, bad: list[Any], match: str
) -> None:
    """Packed token ids are checked in the pass that builds the pack's array; a pack that
    fails is checked input by input, so the error names the prompt, as unpacked."""
    prompts = _token_prompts(60, seed=2)
    prompts[45] = {"prompt_token_ids": bad}
    with pytest.raises(ValueError, match=rf"prompt 45: .*{match}"):
        packer.embed(prompts, use_tqdm=False)
    stats = packer.llm_engine.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert not packer.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=rf"prompt 1: .*{match}"):  # truncation checks first
        packer.embed(prompts[44:46], truncate_prompt_tokens=2, use_tqdm=False)
    (ok,) = packer.embed(prompts[:1], use_tqdm=False)
    assert ok.error is None and len(ok.outputs.embedding) == 32


def test_a_packed_batch_holds_each_input_to_the_model_limit(packer: LLM) -> None:
    """Token ids taken as given for the pack still meet the model's limit: too long fails
    naming the prompt, truncate_prompt_tokens keeps the first tokens and the last [SEP]."""
    prompts = _token_prompts(20, seed=5)
    prompts[7] = {"prompt_token_ids": [2, *range(10, 110), 3]}  # 102 tokens, the limit is 64
    with pytest.raises(ValueError, match=r"prompt 7: .*limit of 64"):
        packer.embed(prompts, use_tqdm=False)
    outputs = packer.embed(prompts, truncate_prompt_tokens=8, use_tqdm=False)
    assert outputs[7].prompt_token_ids == [2, *range(10, 16), 3]
    assert [len(o.prompt_token_ids) for o in outputs] == [
        min(len(p["prompt_token_ids"]), 8) for p in prompts
    ]
    (alone,) = packer.embed([{"prompt_token_ids": outputs[7].prompt_token_ids}], use_tqdm=False)
    np.testing.assert_allclose(outputs[7].outputs.data, alone.outputs.data, rtol=0, atol=2e-6)


def _packed(req_id: str, inputs: list[list[int]], **changes: Any) -> EngineCoreRequest:
    fields: dict[str, Any] = dict(
        request_id=req_id,
        prompt_token_ids=[t for ids in inputs for t in ids],
        pooling_params=PoolingParams(task="embed"),
        input_lens=[len(ids) for ids in inputs],
    )
    fields.update(changes)
    return EngineCoreRequest(**fields)


def test_a_custom_frontend_sends_packs_and_bad_ones_fail_alone(packer: LLM) -> None:
    """The core's own checks: each malformed pack fails alone with a clear error (the core
    keeps serving); a good pack's pooled_output stacks one row per input."""
    a, b, c = [2, 10, 11, 3], [2, 12, 3], [2, 13, 14, 15, 16, 3]
    bad = {
        "sum": _packed("sum", [a, b], input_lens=[4, 4]),
        "zero": _packed("zero", [a, b], input_lens=[7, 0]),
        "empty": _packed("empty", [a], input_lens=[]),
        "encode": _packed("encode", [a, b], pooling_params=PoolingParams(task="encode")),
        "many": _packed("many", [[2, 3]] * 65),
        "budget": _packed("budget", [[2] + [10] * 60 + [3]] * 5),
        "long": _packed("long", [[2] + [10] * 70 + [3], a]),
        "floats": _packed("floats", [a, b], prompt_token_ids=np.array(a + b, np.float32)),
        "2-d": _packed("2-d", [a, a], prompt_token_ids=np.array([a, a])),
        "vocab": _packed("vocab", [a, b], prompt_token_ids=np.array(a + [10**6, 3, 3])),
        "unpacked": _packed("unpacked", [a], prompt_token_ids=np.array(a), input_lens=None),
    }
    good = _packed("good", [a, b, c], prompt_token_ids=np.array(a + b + c, np.int32))
    outputs = _run_core(packer, [*bad.values(), good])
    expected = {
        "sum": "add up to 8 tokens, but the prompt has 7",
        "zero": "positive input lengths",
        "empty": "positive input lengths",
        "encode": "one vector per input",
        "many": "65 packed inputs exceed max_num_seqs=64",
        "budget": "input of 310 tokens exceeds max_num_batched_tokens=256",
        "long": "exceeds the model's limit",
        "floats": "must be 1-D integers",
        "2-d": "must be 1-D integers",
        "vocab": "outside [0, ",
        "unpacked": "an array only for packed inputs",
    }
    for name, message in expected.items():
        out = outputs[name]
        assert out.finish_reason == FinishReason.ERROR and message in (out.error or ""), name
    out = outputs["good"]
    assert out.error is None and out.pooled_output.shape == (3, 32)
    alone = _alone(packer, [{"prompt_token_ids": ids} for ids in (a, b, c)])
    np.testing.assert_allclose(out.pooled_output, np.stack(alone), rtol=0, atol=2e-6)
    stats = packer.llm_engine.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0


def test_a_step_runs_at_most_max_num_seqs_inputs(
    classifier_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed inputs count one sequence each against max_num_seqs, the runner's per-step
    sequence capacity: three packs of 3 with max_num_seqs=8 take two steps."""
    with LLM(classifier_dir, multiprocess=False, max_num_batched_tokens=256, max_num_seqs=8) as llm:
        steps = _record_steps(llm, monkeypatch)
        packs = [_packed(f"p{i}", [[2, 10 + i, 3]] * 3) for i in range(3)]
        outputs = _run_core(llm, packs)
    assert [sorted(s) for s in steps] == [["p0", "p1"], ["p2"]]
    assert all(outputs[p.request_id].pooled_output.shape == (3, 32) for p in packs)


def test_an_unreadable_packed_output_fails_every_input() -> None:
    processor = OutputProcessor(tokenizer=None)
    request = _packed("x+3", [[2, 3], [2, 4, 3], [2, 5, 3]])
    inputs = [("x", [2, 3]), ("y", [2, 4, 3]), ("z", [2, 5, 3])]
    processor.add_packed_request(request, inputs)
    with pytest.raises(ValueError, match="in use"):
        processor.add_packed_request(request, inputs)
    rows = np.zeros((2, 4), np.float32)  # two rows for three inputs
    done = EngineCoreOutput("x+3", [], pooled_output=rows, finish_reason=FinishReason.STOP)
    results, to_abort = processor.process_outputs([done])
    assert [r.request_id for r in results] == ["x", "y", "z"]
    assert all(r.finished and r.outputs is None and "internal error" in r.error for r in results)
    assert [r.prompt_token_ids for r in results] == [ids for _, ids in inputs]
    assert not processor.has_unfinished_requests() and to_abort == ["x+3"]
    processor.add_packed_request(request, inputs)
    ok = EngineCoreOutput(
        "x+3", [], pooled_output=np.eye(3, dtype=np.float32), finish_reason=FinishReason.STOP
    )
    results, _ = processor.process_outputs([ok])
    assert [list(r.outputs.data) for r in results] == np.eye(3).tolist()


def test_a_pack_wider_than_a_runner_row_fails_alone(classifier_dir: str) -> None:
    """With a step budget past POOLING_PACK_TOKENS, a pack is held to the runner's row."""
    with LLM(
        classifier_dir, multiprocess=False, max_num_batched_tokens=4096, max_num_seqs=64
    ) as llm:
        assert pooling_row_tokens(llm.config) == 2048
        wide = _packed("wide", [[2] + [10] * 58 + [3]] * 40)  # 2400 tokens
        fits = _packed("fits", [[2] + [10] * 58 + [3]] * 34)  # 2040 tokens
        outputs = _run_core(llm, [wide, fits])
    assert "packed inputs of 2400 tokens exceed 2048 tokens a request" in outputs["wide"].error
    assert outputs["fits"].error is None and outputs["fits"].pooled_output.shape == (34, 32)


# ---- AsyncLLM (the server's engine): one client request's inputs packed ----
def test_async_llm_packs_a_requests_inputs(
    classifier_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AsyncLLM.encode_packed`: a few core requests for many inputs, each input's output
    under `{request_id}-{i}` equal to its own `encode`; a bad input names itself and queues
    nothing; a cancelled call (the client gone) aborts its packs and leaves nothing behind."""
    import asyncio

    from v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM(classifier_dir, device="cpu", max_num_batched_tokens=256, max_num_seqs=64)
    prompts = _token_prompts(30, seed=9)
    for p in prompts:  # 3-6 tokens: several fit a 32-token pack
        p["prompt_token_ids"] = p["prompt_token_ids"][:6]
    seen: list[EngineCoreRequest] = []
    add = llm.engine_core.add_request_async

    async def recording(request: EngineCoreRequest) -> None:
        seen.append(request)
        await add(request)

    monkeypatch.setattr(llm.engine_core, "add_request_async", recording)

    async def alone(prompt: Any, i: int) -> np.ndarray:
        async for out in llm.encode(prompt, PoolingParams(task="embed"), f"alone-{i}"):
            final = out
        return np.asarray(final.outputs.data)

    async def run() -> None:
        outputs = await llm.encode_packed(prompts, PoolingParams(task="embed"), "r1")
        assert [o.request_id for o in outputs] == [f"r1-{i}" for i in range(len(prompts))]
        packs = [r for r in seen if r.input_lens is not None]
        assert 1 < len(packs) < len(prompts) // 3 and all(r.group_id == "r1" for r in packs)
        for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
            assert out.prompt_token_ids == prompt["prompt_token_ids"]
            ref = await alone(prompt, i)
            np.testing.assert_allclose(out.outputs.data, ref, rtol=0, atol=2e-6)
        bad = [*prompts[:3], {"prompt_token_ids": [2, 10**6, 3]}]
        seen.clear()
        with pytest.raises(ValueError, match="input 3: .*vocabulary"):
            await llm.encode_packed(bad, PoolingParams(task="embed"), "r2")
        assert not seen
        with pytest.raises(ValueError, match="input 1: .*empty"):
            await llm.encode_packed(["gold", ""], PoolingParams(task="embed"), "r3")
        task = asyncio.ensure_future(
            llm.encode_packed(prompts * 4, PoolingParams(task="embed"), "r4")
        )
        while not any(r.request_id.startswith("r4-") for r in seen):
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not llm._queues and not llm.output_processor.has_unfinished_requests()
        for _ in range(200):
            stats = await llm.get_stats()
            if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.02)
        assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
        (again,) = await llm.encode_packed(prompts[:1], PoolingParams(task="embed"), "r4")
        assert again.error is None

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_token_id_arrays_embed_as_lists_do(packer: LLM) -> None:
    """1-D integer numpy arrays as prompt_token_ids (what a tokenizer's return_tensors="np"
    or a dataset gives): packs concatenate them (no per-id Python), every input gets what its
    list gets, packed or alone, truncated or not; outputs keep the caller's ids."""
    lists = _token_prompts(40, seed=11)
    arrays = [
        {"prompt_token_ids": np.asarray(p["prompt_token_ids"], dtype=dtype)}
        for p, dtype in zip(lists, [np.int64, np.int32, np.uint16, np.int16] * 10, strict=True)
    ]
    ref = packer.embed(lists, use_tqdm=False)
    got = packer.embed(arrays, use_tqdm=False)
    mixed = packer.embed(
        [a if i % 2 else p for i, (a, p) in enumerate(zip(arrays, lists, strict=True))],
        use_tqdm=False,
    )
    for r, g, m, a in zip(ref, got, mixed, arrays, strict=True):
        np.testing.assert_allclose(g.outputs.data, r.outputs.data, rtol=0, atol=2e-6)
        np.testing.assert_allclose(m.outputs.data, r.outputs.data, rtol=0, atol=2e-6)
        np.testing.assert_array_equal(g.prompt_token_ids, a["prompt_token_ids"])
    # list(array): lists of numpy integer scalars, packed and alone, as the plain lists.
    scalars = [{"prompt_token_ids": list(a["prompt_token_ids"])} for a in arrays]
    for r, g in zip(ref, packer.embed(scalars, use_tqdm=False), strict=True):
        np.testing.assert_allclose(g.outputs.data, r.outputs.data, rtol=0, atol=2e-6)
    (one,) = packer.embed(scalars[:1], use_tqdm=False)
    np.testing.assert_allclose(one.outputs.data, ref[0].outputs.data, rtol=0, atol=2e-6)
    (alone,) = packer.embed(arrays[:1], use_tqdm=False)
    np.testing.assert_allclose(alone.outputs.data, ref[0].outputs.data, rtol=0, atol=2e-6)
    cut_ref = packer.embed(lists[:6], truncate_prompt_tokens=3, use_tqdm=False)
    cut = packer.embed(arrays[:6], truncate_prompt_tokens=3, use_tqdm=False)
    for r, g in zip(cut_ref, cut, strict=True):
        np.testing.assert_allclose(g.outputs.data, r.outputs.data, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.array([1.0, 2.0]), "1-D integer array, got dtype float64"),
        (np.array([[1, 2], [3, 4]]), r"1-D integer array, got dtype int64 and shape \(2, 2\)"),
        (np.array([5, 10**6]), "token id 1000000 in the input is outside the vocabulary"),
        (np.array([-3, 5]), "token id -3 in the input is outside"),
        (np.array([], dtype=np.int64), "empty"),
        (np.array([True, False]), "1-D integer array, got dtype bool"),
    ],
)
def test_bad_token_id_arrays_name_their_prompt(packer: LLM, bad: Any, match: str) -> None:
    prompts: list[Any] = [
        {"prompt_token_ids": np.asarray(p["prompt_token_ids"])} for p in _token_prompts(30)
    ]
    prompts[21] = {"prompt_token_ids": bad}
    with pytest.raises(ValueError, match=rf"prompt 21: .*{match}"):
        packer.embed(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        packer.embed([prompts[21]], use_tqdm=False)
    assert not packer.llm_engine.has_unfinished_requests()


def test_a_generative_model_takes_token_id_arrays(tmp_path: Any) -> None:
    from tests.utils import make_tiny_llama_dir
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(make_tiny_llama_dir(tmp_path), multiprocess=False) as llm:
        ref = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        got = llm.generate([{"prompt_token_ids": np.array([5, 6, 7])}], params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert got[0].prompt_token_ids == [5, 6, 7]
        with pytest.raises(ValueError, match="1-D integer array"):
            llm.generate([{"prompt_token_ids": np.array([5.0])}], params, use_tqdm=False)
