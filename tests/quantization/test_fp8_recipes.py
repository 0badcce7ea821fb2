"""Which Linear layers quantization="fp8" keeps in the model dtype: the per-model default
recipes (Whisper, BERT family, others), the user's `fp8_ignore` replacing them (module names and
're:' patterns, through EngineCore and the CLI), fp8_ignore on a checkpoint already in fp8, and
the errors for entries that cover nothing or cannot apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.models.test_whisper import make_core as make_whisper_core
from tests.quantization.test_fp8 import generate, is_fp8, is_unquantized, write_fp8_checkpoint
from tests.utils import (
    WHISPER_BASE,
    make_tiny_model_dir,
    make_tiny_whisper_dir,
    make_tiny_wordpiece_tokenizer,
    needs_assets,
)
from tests.worker.worker_factories import make_core as make_worker_core
from tests.worker.worker_factories import make_tiny_bart_dir, runner_of
from v1.config import make_engine_config
from v1.core.engine_core import EngineCore
from v1.models.layers.linear import Linear
from v1.quantization.fp8_rows import dequantize_rows


def make_core(path: str, **overrides: Any) -> EngineCore:
    """A small KV cache: the tests keep several models (and so their caches) alive at once."""
    return make_worker_core(path, num_kv_blocks=64, **overrides)


def linears(core: EngineCore) -> dict[str, torch.nn.Module]:
    model = runner_of(core).model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart_dir(tmp_path_factory.mktemp("bart"))


def test_fp8_ignore_keeps_the_named_layers_and_quantizes_the_rest(bart_dir: str) -> None:
    ignore = ["model.decoder.layers.1", r"re:model\.encoder\.layers\.\d+\.fc2"]
    core = make_core(bart_dir, quantization="fp8", fp8_ignore=ignore)
    reference = linears(make_core(bart_dir))
    kept = {
        name
        for name in reference
        if name.startswith("model.decoder.layers.1.")
        or (name.startswith("model.encoder.layers.") and name.endswith(".fc2"))
    }
    assert len(kept) == 2 + 7  # two encoder fc2, decoder layer 1's seven Linear layers
    for name, layer in linears(core).items():
        if name in kept:
            assert is_unquantized(layer), name
            assert torch.equal(layer.weight, reference[name].weight), name
        else:
            assert is_fp8(layer), name
    tokens = generate(core)
    assert all(len(t) == 6 for t, _ in tokens.values())


def test_encoder_decoder_default_keeps_the_decoder_per_token_linears(bart_dir: str) -> None:
    """BART: the encoder and the cross-attention K/V projections in fp8, the decoder's
    per-token GEMMs (self-attention, cross q/out, fc1/fc2) not."""
    layers = linears(make_core(bart_dir, quantization="fp8"))
    fp8 = {name for name, layer in layers.items() if is_fp8(layer)}
    assert {name for name in layers if name.startswith("model.encoder.")} <= fp8
    assert {f"model.decoder.layers.{i}.encoder_attn.kv_proj" for i in range(2)} <= fp8
    kept = layers.keys() - fp8
    assert kept == {
        f"model.decoder.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.out_proj", "encoder_attn.q_proj")
        + ("encoder_attn.out_proj", "fc1", "fc2")
    }
    assert all(is_unquantized(layers[name]) for name in kept)


def test_decoder_only_models_quantize_every_linear_by_default(tiny_llama_dir: str) -> None:
    layers = linears(make_core(tiny_llama_dir, quantization="fp8"))
    assert layers and all(is_fp8(layer) for layer in layers.values())


@needs_assets(WHISPER_BASE)
def test_whisper_default_recipe_and_an_empty_ignore_list(tmp_path: Path) -> None:
    """Default: encoder layers 0-1 (all of this 2-layer encoder) and the decoder's per-token
    GEMMs stay; the cross-attention K/V projections are fp8. fp8_ignore=[]: every Linear."""
    path = make_tiny_whisper_dir(tmp_path)
    default = linears(make_whisper_core(path, quantization="fp8"))
    fp8 = {name for name, layer in default.items() if is_fp8(layer)}
    assert fp8 == {f"model.decoder.layers.{i}.encoder_attn.kv_proj" for i in range(2)}
    assert all(is_unquantized(default[name]) for name in default.keys() - fp8)
    everything = linears(make_whisper_core(path, quantization="fp8", fp8_ignore=[]))
    assert everything.keys() == default.keys()
    assert all(is_fp8(layer) for layer in everything.values())


def test_bert_default_recipe_quantizes_the_first_third_of_the_layers(tmp_path: Path) -> None:
    """4 layers: layers 0-1 in fp8; layers 2-3, the pooler and the classifier head stay."""
    make_tiny_wordpiece_tokenizer(tmp_path)
    path = make_tiny_model_dir(
        transformers.BertConfig,
        transformers.BertForSequenceClassification,
        tmp_path,
        tokenizer_from=tmp_path,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=3,
    )
    layers = linears(make_core(path, quantization="fp8"))
    fp8 = {name for name, layer in layers.items() if is_fp8(layer)}
    assert fp8 == {
        f"bert.encoder.layer.{i}.{m}"
        for i in range(2)
        for m in ("attention.self.qkv_proj", "attention.output.dense")
        + ("intermediate.dense", "output.dense")
    }
    assert {"bert.pooler.dense", "classifier"} <= layers.keys() - fp8
    assert all(is_unquantized(layers[name]) for name in layers.keys() - fp8)


def test_fp8_ignore_on_a_checkpoint_already_in_fp8(bart_dir: str, tmp_path: Path) -> None:
    """The named layers are dequantized from the checkpoint and stay so; the rest is fp8."""
    from safetensors.torch import load_file

    from v1.quantization.fp8_checkpoint import dequantize_weight

    write_fp8_checkpoint(bart_dir, tmp_path / "ct", "channel")
    kept = "model.encoder.layers.0.fc1"
    layers = linears(make_core(str(tmp_path / "ct"), fp8_ignore=[kept]))
    assert is_unquantized(layers[kept])
    assert all(is_fp8(layer) for name, layer in layers.items() if name != kept)
    stored = load_file(str(tmp_path / "ct" / "model.safetensors"))
    weight = dequantize_weight(stored[f"{kept}.weight"], stored[f"{kept}.weight_scale"], None)
    torch.testing.assert_close(layers[kept].weight, weight, atol=0, rtol=0)
    # Without fp8_ignore the checkpoint decides: that layer is fp8 with the stored values.
    default = linears(make_core(str(tmp_path / "ct")))[kept]
    assert is_fp8(default)
    torch.testing.assert_close(
        dequantize_rows(default.weight, default.weight_scale, torch.float32), weight
    )


def test_fp8_ignore_entries_are_checked(bart_dir: str) -> None:
    with pytest.raises(ValueError, match="covers no Linear layer of BartForConditionalGeneration"):
        make_core(bart_dir, quantization="fp8", fp8_ignore=["model.decoder.layers.0.fc3"])
    # A checkpoint's unfused name is not the engine's (fused qkv_proj): refused, with examples.
    with pytest.raises(ValueError, match=r"named like model\.encoder\.layers\.0\.self_attn"):
        make_core(bart_dir, quantization="fp8", fp8_ignore=["re:.*self_attn\\.q_proj"])
    with pytest.raises(ValueError, match="not a valid regex"):
        make_engine_config(bart_dir, quantization="fp8", fp8_ignore=["re:fc(1"])
    with pytest.raises(ValueError, match="must be a list"):
        make_engine_config(bart_dir, quantization="fp8", fp8_ignore="model.encoder")
    with pytest.raises(ValueError, match="non-empty strings"):
        make_engine_config(bart_dir, quantization="fp8", fp8_ignore=[""])
    with pytest.raises(ValueError, match="fp8_ignore applies to quantization='fp8'"):
        make_engine_config(bart_dir, fp8_ignore=["model.encoder"])


def test_fp8_ignore_from_the_command_line(bart_dir: str) -> None:
    from v1.entrypoints.cli import engine_kwargs, make_parser

    args = make_parser().parse_args(
        ["serve", bart_dir, "--quantization", "fp8", "--fp8-ignore", "model.decoder", "re:.*fc1"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs == {"quantization": "fp8", "fp8_ignore": ["model.decoder", "re:.*fc1"]}
    layers = linears(make_core(bart_dir, **kwargs))
    fp8 = {name for name, layer in layers.items() if is_fp8(layer)}
    assert fp8 == {
        f"model.encoder.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.out_proj", "fc2")
    }
    empty = make_parser().parse_args(["serve", bart_dir, "--fp8-ignore"])
    assert engine_kwargs(empty) == {"fp8_ignore": []}


@needs_assets(WHISPER_BASE)
def test_encoder_norms_hand_fp8_linears_their_output_quantized(tmp_path: Path) -> None:
    """With every Linear in fp8, each pre-norm encoder layer's two norms quantize their output
    for qkv_proj and fc1 (`Fp8Rows`; one kernel on a GPU); the transcripts and logprobs are
    exactly those of the same model whose Linears quantize their input themselves. Under the
    default recipe (encoder layers 0-1 kept) no norm of this 2-layer encoder does."""
    from tests.models.test_whisper import make_builder, make_waves, run_all
    from v1.models.layers.norm import LayerNorm
    from v1.sampling_params import SamplingParams

    path = make_tiny_whisper_dir(tmp_path)

    def norms(core: EngineCore) -> list[LayerNorm]:
        layers = runner_of(core).model.model.encoder.layers
        return [n for layer in layers for n in (layer.self_attn_layer_norm, layer.final_layer_norm)]

    default = make_whisper_core(path, quantization="fp8")
    assert not any(n.fp8_output for n in norms(default))
    results = []
    for linked in (True, False):
        core = make_whisper_core(path, quantization="fp8", fp8_ignore=[])
        assert all(n.fp8_output for n in norms(core))
        for n in norms(core):
            n.fp8_output = linked
        builder = make_builder(core)
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
        requests = [
            builder.build(
                f"r{i}",
                {"prompt": "", "language": "en", "multi_modal_data": {"audio": (w, 16_000)}},
                params,
            )
            for i, w in enumerate(make_waves(3, seed=7))
        ]
        results.append(run_all(core, requests))
    assert results[0] == results[1]
    assert len({tuple(r["tokens"]) for r in results[0].values()}) > 1, "outputs ignore the audio"
