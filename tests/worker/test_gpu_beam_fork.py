"""GPU: beam search with forked KV (device block copies before the step, CUDA graphs and
pipelined steps on) gives transformers' num_beams sequences on the same GPU, and frees every
block. Marked `gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.entrypoints.test_llm_beam_search import _bart, padded
from tests.utils import make_tiny_llama_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PROMPTS = ["the quick brown fox", "hello world, who are you"]


def hf_beams(path: str, is_encoder_decoder: bool, width: int, max_tokens: int) -> tuple:
    """transformers' rows per prompt on the GPU, and the model (its generation config pads)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    auto = AutoModelForSeq2SeqLM if is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            gen = model.generate(
                ids,
                do_sample=False,
                num_beams=width,
                num_return_sequences=width,
                max_new_tokens=max_tokens,
                early_stopping=True,
            )
        start = 1 if is_encoder_decoder else ids.shape[1]
        out.append([row[start:] for row in gen.tolist()])
    return out, model


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_beam_search_forks_on_the_gpu(tmp_path, kind: str, enforce_eager: bool) -> None:
    from v1 import LLM, BeamSearchParams

    torch.backends.cuda.matmul.allow_tf32 = False
    is_encoder_decoder = kind == "bart"
    path = (
        _bart(tmp_path)
        if is_encoder_decoder
        else make_tiny_llama_dir(tmp_path, initializer_range=0.2)
    )
    width, max_tokens = 4, 12
    expected, hf = hf_beams(path, is_encoder_decoder, width, max_tokens)
    with LLM(
        path,
        device="cuda",
        dtype="float32",
        multiprocess=False,
        enforce_eager=enforce_eager,
        block_size=16,
        num_kv_blocks=128,
        max_model_len=64,
    ) as llm:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, early_stopping=True)
        outputs = llm.beam_search(PROMPTS, params)
        stats = llm.llm_engine.get_stats()
    for out, want in zip(outputs, expected, strict=True):
        assert padded([s.token_ids for s in out.sequences], want, hf) == want
    assert stats["num_forks"] > 0 and stats["num_block_copies"] > 0
    assert stats["num_kv_requests"] == 0 and stats["num_used_blocks"] == 0
