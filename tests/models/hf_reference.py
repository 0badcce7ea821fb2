"""Tiny random transformers models as references: build from a config, give every parameter
a random value (norms included, so a mis-mapped weight cannot hide), save as safetensors, and
compare a v1 model's prefill and decode logits with transformers' full-sequence forward."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch import nn

from .harness import PagedRunner

ATOL = 1e-4

VOCAB = 160
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 120, 64, 1, 2], [11], [150, 8, 30, 31, 32, 4]]


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A 2-layer, 64-wide config with 4 query heads over 2 KV heads (where the family has GQA)."""
    if model_type == "gpt2":
        base = dict(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0
        )
        base["eos_token_id"] = 0
    else:
        base = dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    base.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **base)


def randomize_(model: nn.Module, seed: int = 0, std: float = 0.1) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * std
            is_norm_weight = name.endswith("weight") and param.dim() == 1
            param.copy_(noise + 1.0 if is_norm_weight else noise)
    return model


def make_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    cfg = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return randomize_(model, seed).eval()


def save_hf_model(model: nn.Module, path: str | os.PathLike, **kwargs: Any) -> str:
    model.save_pretrained(path, **kwargs)
    return str(path)


@torch.inference_mode()
def hf_logits(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] for one unpadded sequence."""
    out = model(torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


def assert_matches_hf(
    ours: nn.Module,
    hf_model: nn.Module,
    prompts: list[list[int]] = PROMPTS,
    num_decode_steps: int = 4,
) -> list[list[int]]:
    """Prefill all prompts in one packed step, then greedy-decode them together; every step's
    logits must equal transformers' on the whole sequence so far. Returns the sequences."""
    runner = PagedRunner(ours)
    seqs = [list(p) for p in prompts]
    for logits, seq in zip(runner.prefill(prompts), seqs, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq), atol=ATOL, rtol=0)
        seq.append(int(logits[-1].argmax()))
    for _ in range(num_decode_steps):
        step_logits = runner.decode([seq[-1] for seq in seqs])
        for logits, seq in zip(step_logits, seqs, strict=True):
            torch.testing.assert_close(logits, hf_logits(hf_model, seq)[-1], atol=ATOL, rtol=0)
            seq.append(int(logits.argmax()))
    return seqs
