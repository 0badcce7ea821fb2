"""Prompt logprobs for every generating model kind and every max_tokens (1 included): each
prompt token's logprob (after the first) equals transformers' teacher-forced log-softmax of the
previous position, fp32 on CPU. For an encoder-decoder model the prompt is the decoder's (the
decoder start token alone gives [None]; an explicit decoder prompt gives one entry per token).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from tests.utils import make_tiny_bart_dir, make_tiny_llama_dir
from v1 import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog."
DECODER_IDS = [2, 0, 75, 72, 274, 82, 270]
"""An explicit BART decoder prompt: the start token, BOS, then text tokens."""
ENGINE = dict(multiprocess=False, num_kv_blocks=64, block_size=4, max_model_len=64)


def _check(entries: list, ids: list[int], expected: torch.Tensor, num_top: int) -> None:
    """`entries` (RequestOutput.prompt_logprobs) against `expected` [len(ids), vocab]."""
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        entry = entries[position]
        row = expected[position - 1]
        assert entry[ids[position]].logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
        assert [t for _, t in top] == row.topk(num_top).indices.tolist()
        for _, t in top:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"), initializer_range=0.2)


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart_dir(tmp_path_factory.mktemp("bart"), init_std=0.2)


def test_decoder_only_any_max_tokens(llama_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    with LLM(llama_dir, **ENGINE) as llm:
        outs = llm.generate(
            [PROMPT] * 3,
            [
                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0),
                SamplingParams(max_tokens=1, temperature=0),
            ],
        )
        (one_token,) = llm.generate(
            [{"prompt_token_ids": ids[:1]}], SamplingParams(max_tokens=1, prompt_logprobs=2)
        )
    assert outs[0].prompt_token_ids == ids
    assert len(outs[0].outputs[0].token_ids) == 1
    _check(outs[0].prompt_logprobs, ids, expected, 3)
    _check(outs[1].prompt_logprobs, ids, expected, 0)
    assert outs[2].prompt_logprobs is None
    assert one_token.prompt_logprobs == [None]


def test_encoder_decoder_decoder_prompt(bart_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    enc_ids = tokenizer(PROMPT)["input_ids"]
    model = AutoModelForSeq2SeqLM.from_pretrained(bart_dir).float().eval()
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([enc_ids]), decoder_input_ids=torch.tensor([DECODER_IDS])
        ).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    pair = {"encoder_prompt": PROMPT, "decoder_prompt": {"prompt_token_ids": DECODER_IDS}}
    with LLM(bart_dir, **ENGINE) as llm:
        outs = llm.generate(
            [pair, pair, PROMPT],
            [
                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
            ],
        )
    assert outs[0].prompt_token_ids == DECODER_IDS
    _check(outs[0].prompt_logprobs, DECODER_IDS, expected, 2)
    _check(outs[1].prompt_logprobs, DECODER_IDS, expected, 1)
    # The plain prompt's decoder prompt is the start token alone: nothing predicts it.
    assert outs[2].prompt_token_ids == [model.config.decoder_start_token_id]
    assert outs[2].prompt_logprobs == [None]
