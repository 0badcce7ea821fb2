"""LLM.generate end to end on tiny random decoder-only models, against transformers.

The engine runs with a small token budget (chunked prefill) and a KV cache small enough to
preempt, and must still match transformers' greedy tokens and logprobs exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.utils import TINY_LLAMA, make_tiny_llama_dir, make_tiny_model_dir, make_tiny_tokenizer
from v1 import LLM, SamplingParams
from v1.engine.llm_engine import LLMEngine
from v1.entrypoints.llm import RequestFailedError
from v1.outputs import RequestOutputKind
from v1.pooling_params import PoolingParams

ENGINE_ARGS = dict(
    multiprocess=False,
    num_kv_blocks=32,
    block_size=4,
    max_model_len=124,  # the longest request one crowded cache can hold
    max_num_seqs=3,
    max_num_batched_tokens=32,
)
"""31 usable blocks of 4 tokens for 3 requests of up to ~75 tokens: preemption is certain."""

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def batch_prompts(n: int = 8) -> list[dict[str, list[int]]]:
    """Distinct token prompts of 3 to ~60 tokens (several longer than the token budget)."""
    return [
        {"prompt_token_ids": [1] + [(7 * k + 3 * i + k * i) % 370 + 10 for i in range(8 * k + 2)]}
        for k in range(n)
    ]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # A larger init than transformers' default spreads the logits, so greedy never hinges on
    # a near tie.
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"), initializer_range=0.2)


@pytest.fixture(scope="module")
def llm(llama_dir: str):
    with LLM(llama_dir, **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(llama_dir: str):
    return AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def hf_greedy(
    model: Any, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True, **kwargs: Any
):
    """transformers' greedy tokens and the log_softmax of each step's logits."""
    if ignore_eos:
        kwargs["eos_token_id"] = None  # never stop early (the engine's ignore_eos)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return tokens, logprobs


def assert_engine_idle(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0


def copy_model(src: str, dst: Path, generation_config: dict[str, Any] | None = None) -> str:
    shutil.copytree(src, dst)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return str(dst)


# ---- exactness ----


def test_greedy_and_logprobs_match_transformers(llm: LLM, hf_model: Any) -> None:
    prompts = batch_prompts()
    assert max(len(p["prompt_token_ids"]) for p in prompts) > ENGINE_ARGS["max_num_batched_tokens"]
    before = llm.llm_engine.get_stats()["num_preemptions"]
    outputs = llm.generate(prompts, SamplingParams(**{**_fields(GREEDY), "logprobs": 3}))
    assert llm.llm_engine.get_stats()["num_preemptions"] > before
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    for prompt, out in zip(prompts, outputs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt["prompt_token_ids"], MAX_TOKENS)
        (completion,) = out.outputs
        assert completion.token_ids == ref_tokens
        assert completion.finish_reason == "length" and out.finished
        assert len(completion.logprobs) == MAX_TOKENS
        for step, entry in enumerate(completion.logprobs):
            assert len(entry) in (3, 4)  # the sampled token + top-3 (it is the top-1 here)
            assert entry[ref_tokens[step]].rank == 1
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_logprobs[step, token_id].item(), abs=1e-4)
        expected_cumulative = sum(ref_logprobs[i, t].item() for i, t in enumerate(ref_tokens))
        assert completion.cumulative_logprob == pytest.approx(expected_cumulative, abs=1e-3)
    assert_engine_idle(llm)


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_text_prompts_and_prompt_order(llm: LLM, hf_model: Any, llama_dir: str) -> None:
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "A"]
    outputs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    for text, out in zip(texts, outputs, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert out.prompt == text and out.prompt_token_ids == ids
        ref_tokens, _ = hf_greedy(hf_model, ids, 6)
        assert out.outputs[0].token_ids == ref_tokens
        # The same ids as numpy integer scalars (what list(array) gives) generate alike.
        (same,) = llm.generate(
            {"prompt_token_ids": list(np.asarray(ids))},
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        )
        assert same.outputs[0].token_ids == ref_tokens and same.prompt_token_ids == ids
        # The text of a full decode, less an unfinished character at the very end.
        text = tokenizer.decode(ref_tokens, skip_special_tokens=True)
        assert out.outputs[0].text == text.removesuffix("\ufffd")
    single = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6))
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


# ---- sampling ----


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    prompt = batch_prompts()[3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=99, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    ]
    prompts = batch_prompts()
    batch = llm.generate(
        [prompts[0], prompt, prompts[5], prompts[7], prompt],
        [others[0], seeded, others[1], others[2], seeded],
    )
    assert batch[1].outputs[0].token_ids == alone
    assert batch[4].outputs[0].token_ids == alone
    other_seed = llm.generate(prompt, seeded.clone(seed=4321))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_engine_idle(llm)


def test_n_completions(llm: LLM) -> None:
    prompt = batch_prompts()[2]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=1)
    (out,) = llm.generate(prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # Child i runs with seed + i: the same tokens as a single request with that seed.
    for i, completion in enumerate(out.outputs):
        single = llm.generate(prompt, params.clone(n=1, seed=5 + i))[0].outputs[0]
        assert completion.token_ids == single.token_ids and completion.text == single.text
        assert len(completion.logprobs) == 8
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (greedy,) = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=5))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_engine_idle(llm)


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    full = base[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # A stop string made of the 4th and 5th tokens' text: it ends inside token 5 (or later).
    start = len(tokenizer.decode(full.token_ids[:3]))
    stop = full.text[start : start + 3]
    assert len(stop) == 3
    index = full.text.find(stop)
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        (c,) = llm.generate(prompt, params)[0].outputs
        assert c.text == full.text[: index + (len(stop) if include else 0)]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < 16
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    (c,) = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs
    assert c.token_ids == full.token_ids[: first + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == tokenizer.decode(full.token_ids[:first])
    assert_engine_idle(llm)


def _eos_model(llm: LLM, llama_dir: str, path: Path, *, in_model_config: bool):
    """The same weights with the k-th greedy token of a prompt declared EOS (in
    generation_config.json, and in config.json when `in_model_config`)."""
    prompt = batch_prompts()[1]
    greedy = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    path = copy_model(llama_dir, path, {"eos_token_id": greedy[k], "bos_token_id": 1})
    if in_model_config:
        config = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps({**config, "eos_token_id": greedy[k]}))
    return path, prompt, greedy, k


def test_eos_min_tokens_and_ignore_eos(llm: LLM, llama_dir: str, tmp_path: Path) -> None:
    path, prompt, greedy, k = _eos_model(llm, llama_dir, tmp_path / "eos", in_model_config=True)
    eos = greedy[k]
    with LLM(path, **ENGINE_ARGS) as eos_llm:
        outputs = eos_llm.generate(
            [prompt] * 4,
            [
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                GREEDY,
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=k + 3),
                SamplingParams(temperature=0, max_tokens=2),
            ],
        )
        stopped, ignored, at_least, capped = (o.outputs[0] for o in outputs)
        assert stopped.token_ids == greedy[: k + 1]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
        assert ignored.token_ids == greedy and ignored.finish_reason == "length"
        assert at_least.token_ids[:k] == greedy[:k]
        assert len(at_least.token_ids) >= k + 3 and eos not in at_least.token_ids[: k + 3]
        assert capped.token_ids == greedy[:2] and capped.finish_reason == "length"
        assert_engine_idle(eos_llm)


def test_min_tokens_holds_back_a_generation_config_eos(
    llm: LLM, llama_dir: str, tmp_path: Path
) -> None:
    path, prompt, greedy, k = _eos_model(llm, llama_dir, tmp_path / "eos", in_model_config=False)
    with LLM(path, **ENGINE_ARGS) as eos_llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=k + 3)
        (c,) = eos_llm.generate(prompt, params)[0].outputs
        assert greedy[k] not in c.token_ids[: k + 3]


def test_generation_config_defaults_match_transformers(llama_dir: str, tmp_path: Path) -> None:
    """Fields of generation_config.json that change greedy output apply as transformers
    applies them (and explicit params override them)."""
    gen = {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "no_repeat_ngram_size": 2,
        "suppress_tokens": [10, 11, 12],
        "min_length": 12,
        "forced_eos_token_id": 2,
    }
    path = copy_model(llama_dir, tmp_path / "gen", gen)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = batch_prompts(4)
    with LLM(path, **ENGINE_ARGS) as gen_llm:
        outputs = gen_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
        for prompt, out in zip(prompts, outputs, strict=True):
            ref, _ = hf_greedy(hf, prompt["prompt_token_ids"], 20, ignore_eos=False)
            assert out.outputs[0].token_ids == ref
            assert ref[-1] == 2  # forced EOS at the length limit
        # Explicit params win over the generation config.
        (out,) = gen_llm.generate(
            prompts[2],
            SamplingParams(
                temperature=0, max_tokens=20, no_repeat_ngram_size=0, suppress_tokens=[]
            ),
        )
        ref, _ = hf_greedy(
            hf,
            prompts[2]["prompt_token_ids"],
            20,
            ignore_eos=False,
            no_repeat_ngram_size=0,
            suppress_tokens=None,
        )
        assert out.outputs[0].token_ids == ref


# ---- errors ----


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ("", None, "empty"),
        ({"prompt_token_ids": []}, None, "empty"),
        ({"prompt_token_ids": [1, 999999]}, None, "vocabulary"),
        ({"prompt_token_ids": [1, -5]}, None, "vocabulary"),
        ({"prompt_token_ids": list(range(10, 300))}, None, "max_model_len"),
        (["fine", ""], None, "empty"),
        (["fine", "also fine"], [SamplingParams()], "entries for 2 prompts"),
        ("fine", SamplingParams(stop_token_ids=[100000]), "stop_token_ids"),
        ("fine", PoolingParams(), "SamplingParams"),
        ([], None, "non-empty"),
        ([1, 2, 3], None, "prompt_token_ids"),
    ],
)
def test_invalid_input_raises_and_nothing_is_queued(
    llm: LLM, prompts: Any, params: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert_engine_idle(llm)


def test_engine_keeps_serving_after_errors(llm: LLM) -> None:
    for bad in (
        lambda: SamplingParams(temperature=-1),
        lambda: SamplingParams(top_p=0),
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(n=10_000),
        lambda: llm.generate("x", SamplingParams(allowed_token_ids=[10**6])),
        lambda: llm.embed("x"),
        lambda: llm.generate(["a", "b"], priority=[0]),
    ):
        with pytest.raises(ValueError):
            bad()
    out = llm.generate(["still", "serving"], SamplingParams(temperature=0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert_engine_idle(llm)


def test_core_errors_fail_their_request_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the core rejects (here: past the core's max_model_len, with the frontend's
    check switched off) ends with finish_reason "error"; LLM.generate raises after the batch
    with every output, and the engine keeps serving."""
    monkeypatch.setattr(llm.llm_engine.input_processor.builder, "max_model_len", 10**6)
    too_long = {"prompt_token_ids": list(range(10, 300))}
    with pytest.raises(RequestFailedError, match="prompt 1") as info:
        llm.generate(["fine", too_long], SamplingParams(temperature=0, max_tokens=3))
    ok, failed = info.value.outputs
    assert ok.error is None and len(ok.outputs[0].token_ids) == 3
    assert failed.outputs[0].finish_reason == "error" and "max_model_len" in failed.error
    monkeypatch.undo()
    assert len(llm.generate("fine", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    assert_engine_idle(llm)


# ---- engine API ----


def test_streaming_deltas_and_abort(llm: LLM) -> None:
    engine: LLMEngine = llm.llm_engine
    prompt = batch_prompts()[4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zzz"])
    expected = llm.generate(prompt, params)[0].outputs[0]
    engine.add_request("stream", prompt, params, output_kind=RequestOutputKind.DELTA)
    engine.add_request("dropped", prompt, params)
    text, tokens, finished = "", [], False
    num_outputs = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "stream"
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            finished = out.finished
            num_outputs += 1
        if num_outputs == 2:
            engine.abort_request(["dropped"])
    assert finished and num_outputs > 2
    assert tokens == expected.token_ids and text == expected.text
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    ("arch", "make"),
    [
        ("qwen2", lambda path: _tiny_qwen2(path)),
        ("gpt2", lambda path: _tiny_gpt2(path)),
    ],
)
def test_other_decoder_only_architectures(arch: str, make: Any, tmp_path: Path) -> None:
    path = make(tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = batch_prompts(5)
    with LLM(path, **ENGINE_ARGS) as model:
        outputs = model.generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        )
        for prompt, out in zip(prompts, outputs, strict=True):
            ref, _ = hf_greedy(hf, prompt["prompt_token_ids"], 10)
            assert out.outputs[0].token_ids == ref


def _tiny_qwen2(path: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return make_tiny_model_dir(
        Qwen2Config, Qwen2ForCausalLM, path, **{**TINY_LLAMA, "initializer_range": 0.2}
    )


def _tiny_gpt2(path: Path) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    path.mkdir(parents=True)
    make_tiny_tokenizer(path, add_bos=False)
    return make_tiny_model_dir(
        GPT2Config,
        GPT2LMHeadModel,
        path,
        tokenizer_from=path,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,
    )


def test_multiprocess_engine_matches_in_process(llama_dir: str, llm: LLM) -> None:
    pytest.importorskip("v1.core.mp_client")
    prompts = batch_prompts(4)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(llama_dir, **{**ENGINE_ARGS, "multiprocess": True}) as mp_llm:
        got = [o.outputs[0].token_ids for o in mp_llm.generate(prompts, GREEDY)]
        assert got == expected
        assert mp_llm.llm_engine.get_stats()["num_kv_requests"] == 0
