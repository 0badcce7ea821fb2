"""LLM.beam_search against transformers' generate(num_beams=...): the same sequences and
`sequences_scores` for tiny random BART, T5, Marian, Llama and GPT-2, over beam widths, length
penalties and the three early_stopping modes; beams share one cross cache and one encoder run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

from tests.utils import (
    ONE_TORCH_THREAD,
    make_tiny_bart_dir,
    make_tiny_llama_dir,
    make_tiny_model_dir,
    make_tiny_t5_dir,
    make_tiny_tokenizer,
)
from v1 import LLM, BeamSearchParams

pytestmark = ONE_TORCH_THREAD

MAX_TOKENS = 10
TEXTS = ["the quick brown fox", "hello world, who are you"]
ENGINE_ARGS = dict(multiprocess=False, num_kv_blocks=256, block_size=4, max_model_len=64)


def _bart(path: Path) -> str:
    make_tiny_bart_dir(path, init_std=0.2)
    generation = {
        "decoder_start_token_id": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "forced_bos_token_id": 1,
        "forced_eos_token_id": 2,
        "no_repeat_ngram_size": 3,
    }
    (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def _marian(path: Path) -> str:
    return make_tiny_bart_dir(
        path, family="marian", add_bos=False, decoder_start_token_id=0, init_std=0.2
    )


def _t5(path: Path) -> str:
    return make_tiny_t5_dir(
        path, feed_forward_proj="gated-gelu", tie_word_embeddings=False, initializer_factor=5.0
    )


def _llama(path: Path) -> str:
    return make_tiny_llama_dir(path, initializer_range=0.2)


def _gpt2(path: Path) -> str:
    make_tiny_tokenizer(path, add_bos=False)
    return make_tiny_model_dir(
        GPT2Config,
        GPT2LMHeadModel,
        path,
        tokenizer_from=path,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        initializer_range=0.2,
    )


MODELS: dict[str, tuple[Callable[[Path], str], bool]] = {
    "bart": (_bart, True),
    "t5": (_t5, True),
    "marian": (_marian, True),
    "llama": (_llama, False),
    "gpt2": (_gpt2, False),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    make, is_encoder_decoder = MODELS[request.param]
    path = make(tmp_path_factory.mktemp(request.param))
    auto = AutoModelForSeq2SeqLM if is_encoder_decoder else AutoModelForCausalLM
    hf = auto.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LLM(path, **ENGINE_ARGS) as llm:
        yield request.param, llm, hf, tokenizer, is_encoder_decoder


def hf_beam_search(
    hf: Any, tokenizer: Any, text: str, is_encoder_decoder: bool, **kwargs: Any
) -> tuple[list[list[int]], list[float] | None]:
    """transformers' (generated tokens, padded as transformers pads them, sequences_scores)."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(
            ids,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    start = 1 if is_encoder_decoder else ids.shape[1]
    scores = getattr(out, "sequences_scores", None)
    return [row[start:] for row in out.sequences.tolist()], (
        None if scores is None else scores.tolist()
    )


def padded(sequences: list[list[int]], like: list[list[int]], hf: Any) -> list[list[int]]:
    """`sequences` padded to the width of transformers' rows, with what its beam search fills
    them (`pad_token_id or eos_token_id[0]`: a pad id of 0 gives EOS)."""
    g = hf.generation_config
    eos = g.eos_token_id[0] if isinstance(g.eos_token_id, list) else g.eos_token_id
    fill = g.pad_token_id or eos
    width = max(len(row) for row in like)
    return [s + [fill] * (width - len(s)) for s in sequences]


LENGTH_PENALTIES = (0.6, 1.0, 2.0)
EARLY_STOPPING = (True, False, "never")
CASES = [
    # (beam_width, num_return_sequences, length_penalty, early_stopping): every length
    # penalty with every early_stopping mode, widths 2 and 4 in turn.
    (width, num_return, length_penalty, early_stopping)
    for k, (length_penalty, early_stopping) in enumerate(
        (lp, es) for lp in LENGTH_PENALTIES for es in EARLY_STOPPING
    )
    for width, num_return in [((2, 2), (4, 3))[k % 2]]
]


def test_beam_search_matches_transformers(model) -> None:
    name, llm, hf, tokenizer, is_encoder_decoder = model
    for width, num_return, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            num_return_sequences=num_return,
        )
        outputs = llm.beam_search(TEXTS, params)
        for text, output in zip(TEXTS, outputs, strict=True):
            expected, scores = hf_beam_search(
                hf,
                tokenizer,
                text,
                is_encoder_decoder,
                num_beams=width,
                num_return_sequences=num_return,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
            )
            case = f"{name} width={width} lp={length_penalty} early_stopping={early_stopping}"
            got = padded([s.token_ids for s in output.sequences], expected, hf)
            assert got == expected, case
            assert [s.score for s in output.sequences] == pytest.approx(scores, abs=2e-4), case


def test_width_one_is_greedy(model) -> None:
    name, llm, hf, tokenizer, is_encoder_decoder = model
    (output,) = llm.beam_search(TEXTS[0], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS))
    expected, _ = hf_beam_search(hf, tokenizer, TEXTS[0], is_encoder_decoder, num_beams=1)
    got = padded([s.token_ids for s in output.sequences], expected, hf)
    assert got == expected, name


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_width=0, max_tokens=4),
        dict(beam_width=11, max_tokens=4),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=2, max_tokens=4, early_stopping="sometimes"),
        dict(beam_width=2, max_tokens=4, num_return_sequences=3),
        dict(beam_width=2, max_tokens=4, length_penalty=float("nan")),
        dict(beam_width=2, max_tokens=4, patience=0.0),
    ],
)
def test_bad_beam_search_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        BeamSearchParams(**kwargs)


def test_bad_beam_search_calls_raise_and_leak_nothing(model) -> None:
    name, llm, *_ = model
    from v1 import SamplingParams

    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(TEXTS[0], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1"):
        llm.beam_search(
            [TEXTS[0], {"prompt_token_ids": [10**7]}], BeamSearchParams(beam_width=2, max_tokens=4)
        )
    stats = llm.llm_engine.get_stats()
    assert stats["num_kv_requests"] == 0 and stats["num_requests"] == 0, name


def test_extra_eos_and_min_tokens_like_transformers(model) -> None:
    """stop_token_ids end beams as further EOS ids (transformers: an eos_token_id list, which
    keeps more candidates per step); min_tokens masks them all like min_new_tokens."""
    name, llm, hf, tokenizer, is_encoder_decoder = model
    if name not in ("bart", "gpt2"):
        pytest.skip("one model of each kind is enough")
    from v1 import SamplingParams

    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, num_return_sequences=2)
    (free,) = llm.beam_search(TEXTS[1], params)
    stop = free.sequences[0].token_ids[2]  # the best beam's third token now ends beams
    eos = hf.generation_config.eos_token_id
    for min_tokens in (0, 8):
        sampling = SamplingParams(stop_token_ids=[stop], min_tokens=min_tokens)
        (output,) = llm.beam_search(TEXTS[1], params, sampling_params=sampling)
        expected, scores = hf_beam_search(
            hf,
            tokenizer,
            TEXTS[1],
            is_encoder_decoder,
            num_beams=3,
            num_return_sequences=2,
            eos_token_id=[eos, stop],
            min_new_tokens=min_tokens,
        )
        lengths = [len(s.token_ids) for s in output.sequences]
        assert padded([s.token_ids for s in output.sequences], expected, hf) == expected
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=2e-4)
        if min_tokens:
            assert min(lengths) >= min_tokens
        else:
            assert min(lengths) < MAX_TOKENS  # the stop token ended a beam early


def test_multiprocess_engine_gives_the_same_beams(model) -> None:
    """Over ZMQ: beam steps carry output_token_ids, name their encoder input by hash after
    the first step, and bring back -inf logprobs of masked tokens."""
    name, llm, *_ = model
    if name != "bart":
        pytest.skip("one encoder-decoder model is enough")
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, num_return_sequences=3)
    expected = llm.beam_search(TEXTS, params)
    path = llm.config.model_config.model
    with LLM(path, **{**ENGINE_ARGS, "multiprocess": True}) as mp_llm:
        got = mp_llm.beam_search(TEXTS, params)
        stats = mp_llm.llm_engine.get_stats()
    for a, b in zip(expected, got, strict=True):
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences])
    assert stats["num_encoder_runs"] == len(TEXTS) and stats["num_kv_requests"] == 0
