"""Prompt logprobs (SamplingParams.prompt_logprobs, the server's echo with logprobs) through
`v1.LLM`: each prompt token's logprob equals transformers' log-softmax of the previous position,
across prefill chunks, with and without pipelined steps, for n > 1 and beside prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils import make_tiny_llama_dir
from v1 import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"), initializer_range=0.2)


@pytest.fixture(scope="module")
def reference(llama_dir: str) -> tuple[list[int], torch.Tensor]:
    """(prompt ids, transformers' logprobs [len, vocab] of the token after each position)."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_transformers(
    llama_dir: str, reference: tuple[list[int], torch.Tensor], async_scheduling: bool
) -> None:
    ids, logprobs = reference
    with LLM(
        llama_dir,
        multiprocess=False,
        num_kv_blocks=80,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=16,  # the prompt is computed in chunks
        async_scheduling=async_scheduling,
    ) as llm:
        llm.generate([PROMPT], SamplingParams(max_tokens=1))  # fills the prefix cache
        outs = llm.generate(
            [PROMPT, PROMPT, PROMPT],
            [
                SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
                SamplingParams(max_tokens=2, temperature=1.0, n=2, prompt_logprobs=0),
                SamplingParams(max_tokens=2, temperature=0),
            ],
        )
    assert outs[2].prompt_logprobs is None
    assert outs[2].num_cached_tokens > 0  # the neighbour without prompt logprobs hits the cache
    for out, num_top in ((outs[0], 2), (outs[1], 0)):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        for position in range(1, len(ids)):
            entry = entries[position]
            expected = logprobs[position - 1]
            assert entry[ids[position]].logprob == pytest.approx(
                expected[ids[position]].item(), abs=1e-4
            )
            top = [t for t, lp in entry.items() if lp.rank is not None]
            assert len(top) == num_top
            assert top == expected.topk(num_top).indices.tolist() if num_top else top == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prompt_logprobs_on_gpu(llama_dir: str, reference: tuple[list[int], torch.Tensor]) -> None:
    ids, logprobs = reference
    with LLM(
        llama_dir,
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        block_size=16,
        max_model_len=128,
    ) as llm:
        (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=1))
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    for position in range(1, len(ids)):
        assert entries[position][ids[position]].logprob == pytest.approx(
            logprobs[position - 1][ids[position]].item(),
            abs=2e-2,  # bf16/fp16 weights on GPU
        )
