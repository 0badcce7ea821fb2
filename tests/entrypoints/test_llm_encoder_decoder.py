"""LLM.generate on a tiny random BART: prompt forms and generation-config defaults, exactly as
transformers' generate (forced BOS/EOS, no_repeat_ngram_size, min_length, decoder prompts)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, BartForConditionalGeneration

from tests.utils import make_tiny_bart_dir
from v1 import LLM, SamplingParams

pytest.importorskip("v1.models.bart")

GENERATION_CONFIG = {
    "decoder_start_token_id": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "forced_bos_token_id": 1,
    "forced_eos_token_id": 2,
    "no_repeat_ngram_size": 2,
    "min_length": 5,
}
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "To be or not to be"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bart")
    make_tiny_bart_dir(path, init_std=0.2)  # tokenizer: <s> text </s>, as BART
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def hf(bart_dir: str) -> tuple[Any, Any]:
    model = BartForConditionalGeneration.from_pretrained(bart_dir).eval()
    return model, AutoTokenizer.from_pretrained(bart_dir)


def hf_generate(hf: tuple[Any, Any], text: str, decoder_text: str | None = None, **kw: Any):
    model, tokenizer = hf
    if decoder_text is not None:
        dec = tokenizer(decoder_text, add_special_tokens=False, return_tensors="pt").input_ids
        kw["decoder_input_ids"] = dec
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=12, **kw)[0].tolist()
    start = 1 + (dec.shape[1] if decoder_text is not None else 0)  # decoder start + prompt
    return out[start:]


def test_greedy_with_generation_defaults_matches_transformers(bart_dir: str, hf) -> None:
    with LLM(bart_dir, multiprocess=False, num_kv_blocks=64, block_size=4) as llm:
        outputs = llm.generate(TEXTS, GREEDY)
        pair = {"encoder_prompt": TEXTS[1], "decoder_prompt": "the"}
        (with_decoder_prompt,) = llm.generate(pair, GREEDY)
        (overridden,) = llm.generate(
            TEXTS[1], SamplingParams(temperature=0, max_tokens=12, no_repeat_ngram_size=0)
        )
    tokenizer = hf[1]
    for text, out in zip(TEXTS, outputs, strict=True):
        assert out.encoder_prompt == text and out.prompt is None
        assert out.encoder_prompt_token_ids == tokenizer(text)["input_ids"]
        assert out.prompt_token_ids == [2]
        tokens = out.outputs[0].token_ids
        assert tokens == hf_generate(hf, text)
        assert tokens[0] == 1  # forced BOS
        assert len(tokens) >= 4  # min_length 5 counts the decoder start token
    assert with_decoder_prompt.prompt == "the"
    assert with_decoder_prompt.prompt_token_ids[0] == 2
    assert with_decoder_prompt.outputs[0].token_ids == hf_generate(hf, TEXTS[1], "the")
    assert overridden.outputs[0].token_ids == hf_generate(hf, TEXTS[1], no_repeat_ngram_size=0)
