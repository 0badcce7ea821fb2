"""Llama, Mistral and Qwen2 through the v1 loader and paged attention vs transformers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from tests.utils import TINY_LLAMA, make_tiny_model_dir
from v1 import LLM, SamplingParams
from v1.config import ModelConfig
from v1.models.llama import LlamaForCausalLM
from v1.worker.model_loader import construct_model, iterate_weights, load_model

from .harness import PagedRunner
from .hf_reference import ATOL, PROMPTS, assert_matches_hf, hf_logits, make_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-bias-yarn-rope": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "rope_parameters": YARN_ROPE},
    ),
    "mistral-linear-rope-head_dim": (
        "mistral",
        {"head_dim": 32, "rope_parameters": LINEAR_ROPE, "sliding_window": None},
    ),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
}


def load_ours(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(ModelConfig(model=path), "cpu", dtype)


@pytest.fixture(params=list(VARIANTS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_type, overrides = VARIANTS[request.param]
    hf_model = make_hf_model(model_type, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return hf_model, str(path)


def test_prefill_and_decode_match_transformers(checkpoint: tuple[Any, str]) -> None:
    hf_model, path = checkpoint
    ours = load_ours(path)
    assert isinstance(ours, LlamaForCausalLM)
    seqs = assert_matches_hf(ours, hf_model)
    assert [len(s) for s in seqs] == [len(p) + 5 for p in PROMPTS]


def test_load_weights_covers_every_parameter(checkpoint: tuple[Any, str]) -> None:
    hf_model, path = checkpoint
    ours = construct_model(hf_model.config, "cpu", torch.float32)
    loaded = ours.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in ours.named_parameters()}
    ours_numel = sum(p.numel() for p in ours.parameters())
    assert ours_numel == sum(p.numel() for p in hf_model.parameters())


def test_tied_head_shares_the_embedding(checkpoint: tuple[Any, str]) -> None:
    hf_model, path = checkpoint
    ours = load_ours(path)
    tied = hf_model.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    torch.testing.assert_close(ours.lm_head.weight, hf_model.lm_head.weight, atol=0, rtol=0)


def test_chunked_prefill_mixed_with_decode(tmp_path) -> None:
    """A step mixing a prompt chunk of one request with a decode token of another."""
    hf_model = make_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    hf_model.save_pretrained(tmp_path)
    runner = PagedRunner(load_ours(str(tmp_path)))
    long, short = PROMPTS[0], PROMPTS[2]
    a, b = runner.add_sequences(2)
    first = runner.step({a: long[:5], b: short})
    next_b = int(first[b][-1].argmax())
    mixed = runner.step({a: long[5:], b: [next_b]})
    torch.testing.assert_close(
        torch.cat([first[a], mixed[a]]), hf_logits(hf_model, long), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        mixed[b][0], hf_logits(hf_model, [*short, next_b])[-1], atol=ATOL, rtol=0
    )


def test_bfloat16_load(tmp_path) -> None:
    hf_model = make_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path)
    ours = load_ours(str(tmp_path), torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    logits = PagedRunner(ours).prefill([PROMPTS[0]])[0]
    assert logits.dtype == torch.bfloat16  # the model dtype: the samplers upcast
    torch.testing.assert_close(
        logits.float(), hf_logits(hf_model, PROMPTS[0]), atol=0.15, rtol=0.05
    )


# ---- sliding windows: not implemented, so max_model_len is capped at the window ----

WINDOW = 16


def test_sliding_window_model_is_exact_inside_the_window_only() -> None:
    """Full attention equals transformers' windowed attention up to WINDOW tokens (a 10-token
    prompt and 6 greedy steps) and not beyond: why ModelConfig caps max_model_len there."""
    hf_model = make_hf_model("mistral", sliding_window=WINDOW)
    ours = LlamaForCausalLM(hf_model.config)
    ours.load_weights(hf_model.state_dict().items())
    prompt = PROMPTS[0][:10]
    seqs = assert_matches_hf(ours, hf_model, prompts=[prompt], num_decode_steps=5)
    assert len(seqs[0]) == WINDOW
    long_prompt = (PROMPTS[0] * 3)[: WINDOW + 8]
    logits = PagedRunner(ours).prefill([long_prompt])[0]
    expected = hf_logits(hf_model, long_prompt)
    torch.testing.assert_close(logits[:WINDOW], expected[:WINDOW], atol=ATOL, rtol=0)
    assert not torch.allclose(logits[WINDOW:], expected[WINDOW:], atol=ATOL, rtol=0)


def test_llm_caps_max_model_len_at_the_sliding_window(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = make_tiny_model_dir(
        MistralConfig,
        MistralForCausalLM,
        tmp_path,
        **{**TINY_LLAMA, "sliding_window": WINDOW, "initializer_range": 0.2},
    )
    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = [1, *range(40, 49)]  # 10 tokens
    args = dict(multiprocess=False, device="cpu", block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=f"sliding window of {WINDOW}"):
        LLM(path, max_model_len=2 * WINDOW, **args)
    with caplog.at_level(logging.WARNING, logger="v1.config"), LLM(path, **args) as llm:
        assert llm.llm_engine.model_config.effective_max_model_len == WINDOW
        outputs = llm.generate(
            [{"prompt_token_ids": prompt}] * 2,
            [
                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),  # cut at WINDOW
            ],
            use_tqdm=False,
        )
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate({"prompt_token_ids": list(range(40, 40 + WINDOW))}, use_tqdm=False)
    assert any("sliding-window" in r.getMessage() for r in caplog.records)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6
        )
    expected = out[0, len(prompt) :].tolist()
    for output in outputs:
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].finish_reason == "length"
