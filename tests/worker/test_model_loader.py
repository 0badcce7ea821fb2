"""The loader: safetensors only, sharded checkpoints, hub resolution, loud missing/unexpected."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_reference import assert_matches_hf, make_hf_model
from v1.config import ModelConfig
from v1.models import registry
from v1.models.gpt2 import GPT2LMHeadModel
from v1.models.llama import LlamaForCausalLM
from v1.worker import model_loader
from v1.worker.model_loader import (
    iterate_weights,
    load_model,
    load_model_from_weights,
    weight_files,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory):
    hf_model = make_hf_model("llama")
    path = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(path)
    return hf_model, path


def rewrite(src, dst, drop: str | None = None, add: dict | None = None) -> str:
    """Copy the checkpoint at `src` to `dst` without tensor `drop` and with `add`."""
    tensors = load_file(src / "model.safetensors")
    if drop is not None:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return str(dst)


def load(path) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(path)), "cpu", torch.float32)


def test_refuses_pickled_checkpoints(llama_dir, tmp_path) -> None:
    hf_model, src = llama_dir
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        load(tmp_path)
    with pytest.raises(ValueError, match="safetensors only"):
        list(iterate_weights([str(tmp_path / "pytorch_model.bin")]))


def test_empty_folder_has_no_weights(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        weight_files(str(tmp_path))


def test_missing_tensor_is_named(llama_dir, tmp_path) -> None:
    _, src = llama_dir
    name = "model.layers.1.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match=rf"missing 1 parameter.*{name}"):
        load(rewrite(src, tmp_path, drop=name))


def test_missing_shard_of_a_fused_parameter_is_named(llama_dir, tmp_path) -> None:
    _, src = llama_dir
    path = rewrite(src, tmp_path, drop="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight.*not \['k'\]"):
        load(path)


def test_unexpected_tensor_is_named(llama_dir, tmp_path) -> None:
    _, src = llama_dir
    extra = {"model.layers.0.self_attn.extra_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"match no parameter.*extra_proj\.weight"):
        load(rewrite(src, tmp_path, add=extra))


def test_known_ignorable_tensors_are_skipped(llama_dir, tmp_path) -> None:
    hf_model, src = llama_dir
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    ours = load(rewrite(src, tmp_path, add=extra))
    assert_matches_hf(ours, hf_model, num_decode_steps=0)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path) -> None:
    _, src = llama_dir
    bad = {"model.norm.weight": torch.ones(65)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(64,\).*\(65,\)"):
        load(rewrite(src, tmp_path, add=bad))


def test_sharded_checkpoint(llama_dir, tmp_path) -> None:
    hf_model, _ = llama_dir
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    files = weight_files(str(tmp_path))
    assert len(files) > 1 and (tmp_path / model_loader.SAFETENSORS_INDEX).exists()
    assert_matches_hf(load(tmp_path), hf_model, num_decode_steps=1)


def test_hub_id_downloads_safetensors_only_at_revision(llama_dir, monkeypatch) -> None:
    hf_model, src = llama_dir
    calls = []

    def fake_snapshot_download(repo_id: str, **kwargs) -> str:
        calls.append((repo_id, kwargs))
        return str(src)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    config = ModelConfig(model="org/tiny-llama", revision="v2", hf_config=hf_model.config)
    ours = load_model(config, "cpu", torch.float32)
    assert isinstance(ours, LlamaForCausalLM)
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/tiny-llama" and kwargs["revision"] == "v2"
    assert "*.safetensors" in kwargs["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt")) for p in kwargs["allow_patterns"])


def test_load_model_from_weights_needs_every_parameter(llama_dir) -> None:
    hf_model, src = llama_dir
    weights = [(n, t) for n, t in iterate_weights(str(src)) if "embed_tokens" not in n]
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight"):
        load_model_from_weights(hf_model.config, weights, "cpu", torch.float32)


def test_registry_lazy_classes_and_errors(monkeypatch) -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert registry.get_model_class(arch) is LlamaForCausalLM
    assert registry.get_model_class("GPT2LMHeadModel") is GPT2LMHeadModel
    for arch in ("WhisperForConditionalGeneration", "T5EncoderModel", "BertModel", "MarianMTModel"):
        assert arch in registry.supported_architectures()
        assert registry.get_model_spec(arch).classes[arch].endswith(f":{arch}")
    with pytest.raises(ValueError, match=r"'FooForCausalLM' is not supported.*LlamaForCausalLM"):
        registry.get_model_class("FooForCausalLM")
    ghost = dataclasses.replace(
        registry.get_model_spec("LlamaForCausalLM"),
        classes={"Ghost": "v1.models.no_such_module:Ghost"},
    )
    monkeypatch.setitem(registry._BY_ARCHITECTURE, "Ghost", ghost)
    with pytest.raises(ImportError, match="no_such_module"):
        registry.get_model_class("Ghost")


@pytest.mark.parametrize("bias", [False, True])
def test_padded_lm_head_gives_the_same_logits_and_keeps_the_tie(bias: bool) -> None:
    """`LMHead.pad_vocab_` (the loader calls it on CUDA): an odd vocabulary moves into
    storage padded to 64 rows; logits, the tied embedding's lookups and the parameters'
    shapes stay the same."""
    from v1.models.layers.embedding import LMHead, VocabEmbedding

    gen = torch.Generator().manual_seed(0)
    embed = VocabEmbedding(101, 24)
    embed.weight.data = torch.randn(101, 24, generator=gen)
    head = LMHead(101, 24, bias=bias, tie_to=embed)
    if bias:
        head.bias.data = torch.randn(101, generator=gen)
    hidden = torch.randn(5, 24, generator=gen)
    ids = torch.tensor([0, 57, 100])
    logits, rows = head(hidden), embed(ids)

    assert head.pad_vocab_(64)
    assert not head.pad_vocab_(64)  # once
    padded, padded_bias = head._padded
    assert padded.shape == (128, 24) and head.weight.shape == (101, 24)
    assert head.weight.data_ptr() == padded.data_ptr() and embed.weight is head.weight
    assert not padded[101:].any()
    if bias:
        assert head.bias.shape == (101,) and head.bias.data_ptr() == padded_bias.data_ptr()
    out = head(hidden)
    assert out.shape == (5, 101) and out.stride(1) == 1  # a view of the padded GEMM output
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(embed(ids), rows, rtol=0, atol=0)
    assert not LMHead(128, 24).pad_vocab_(64)  # already a multiple
