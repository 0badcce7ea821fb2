"""Tiny random transformers models as references: build from a config, give every parameter
a random value (norms included, so a mis-mapped weight cannot hide), save as safetensors."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch import nn

VOCAB = 160
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 120, 64, 1, 2], [11], [150, 8, 30, 31, 32, 4]]


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A 2-layer, 64-wide config with 4 query heads over 2 KV heads (where the family has GQA)."""
    if model_type == "gpt2":
        base = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
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
