"""GPT-2 through the v1 loader and paged attention vs transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from v1.config import ModelConfig
from v1.models.gpt2 import GPT2LMHeadModel
from v1.worker.model_loader import construct_model, iterate_weights, load_model

from .hf_reference import assert_matches_hf, make_hf_model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": False, "activation_function": "gelu"},
        {"scale_attn_by_inverse_layer_idx": True, "n_inner": 96},
    ],
    ids=["tied-gelu_new", "untied-gelu", "layer-scaled"],
)
def test_prefill_and_decode_match_transformers(tmp_path, overrides: dict) -> None:
    hf_model = make_hf_model("gpt2", **overrides)
    hf_model.save_pretrained(tmp_path)
    ours = load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)
    assert isinstance(ours, GPT2LMHeadModel)
    assert (
        ours.lm_head.weight is ours.transformer.wte.weight
    ) == hf_model.config.tie_word_embeddings
    assert_matches_hf(ours, hf_model)
    loaded = construct_model(hf_model.config, "cpu", torch.float32).load_weights(
        iterate_weights(str(tmp_path))
    )
    assert loaded == {name for name, _ in ours.named_parameters()}


def test_original_openai_checkpoint_names(tmp_path) -> None:
    """openai-community/gpt2 stores names without "transformer." and the causal-mask buffers."""
    hf_model = make_hf_model("gpt2")
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    for i in range(hf_model.config.n_layer):
        renamed[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        renamed[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(renamed, tmp_path / "model.safetensors")
    ours = load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)
    assert_matches_hf(ours, hf_model, num_decode_steps=1)
