"""FP8 weights and activations (quantization="fp8"): the row quantizer, fp8 Linear layers
(the CPU dequantize-then-matmul reference; torch._scaled_mm on a GPU, GPU-marked), the real
whisper-base and MiniLM against float32, and checkpoints already in fp8 (compressed-tensors
per channel, quant_method "fp8" per tensor with static input scales, block-wise scales, an
ignore list) loading to the same model quantization="fp8" builds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.harness import small_whisper_config, uniform_encoder_context
from tests.utils import ASSETS, ONE_TORCH_THREAD
from tests.worker.worker_factories import (
    bart_inputs,
    decoder_request,
    make_core,
    make_tiny_bart_dir,
    runner_of,
)
from v1.core.engine_core import EngineCore
from v1.models.layers.linear import Linear
from v1.quantization.fp8 import Fp8LinearMethod, quantize_model_fp8
from v1.quantization.fp8_rows import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Product,
    dequantize_rows,
    fp8_gemm_reference,
    quantize_rows,
)
from v1.sampling_params import SamplingParams

pytestmark = ONE_TORCH_THREAD

WHISPER_BASE = ASSETS / "whisper-base"
MINILM = ASSETS / "all-MiniLM-L6-v2"
AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]


# ---- the quantizer and the GEMM ----


def test_quantize_rows_round_trips_within_fp8_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[5] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (64,) and bool((scale > 0).all())
    assert torch.equal(q.float().abs().amax(-1)[torch.arange(64) != 5], torch.full((63,), FP8_MAX))
    back = dequantize_rows(q, scale, torch.float32)
    assert not back[5].any()
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for values in normal range.
    normal = x.abs() >= scale[:, None] * 2**-6
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[normal]
    assert float(rel.max()) <= 2**-4 + 1e-6


def test_fp8_linear_is_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = Linear(48, 32, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 48, generator=gen))
        layer.bias.copy_(torch.randn(32, generator=gen))
    x = torch.randn(3, 5, 48, generator=gen)
    exact = layer(x)
    quantize_model_fp8(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (32,)
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    out = layer(x)
    x_q, x_scale = quantize_rows(x.reshape(15, 48))
    expected = fp8_gemm_reference(x_q, x_scale, layer.weight, layer.weight_scale) + layer.bias
    torch.testing.assert_close(out, expected.view(3, 5, 32), atol=1e-5, rtol=1e-5)
    assert 0 < float((out - exact).abs().max()) < 0.1 * float(exact.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_matches_the_reference_on_gpu(dtype: torch.dtype) -> None:
    from v1.quantization.fp8 import scaled_mm_out_dtype

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    assert scaled_mm_out_dtype(torch.device("cuda"), dtype) is not None
    gen = torch.Generator().manual_seed(2)
    layer = Linear(256, 512, bias=True).to("cuda", dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(512, 256, generator=gen))
        layer.bias.copy_(torch.randn(512, generator=gen))
    quantize_model_fp8(layer)
    assert layer.quant_method.scaled_mm_out is not None
    from v1.quantization.fp8_rows import quantize_activations

    for num_tokens in (1, 7, 300):
        x = torch.randn(num_tokens, 256, generator=gen).to("cuda", dtype)
        x_q, x_scale = quantize_activations(x)  # the layer's quantizer
        expected = fp8_gemm_reference(x_q, x_scale, layer.weight, layer.weight_scale)
        expected = (expected.to(dtype) + layer.bias).float()
        # The fused kernel rounds its output once, the reference twice (product, then + bias):
        # allow a few output ulps (bf16 has 8 mantissa bits: one ulp is 0.4-0.8%).
        rtol = max(1e-2, 4 * torch.finfo(dtype).eps)
        torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (300, 1280), (4096, 5120), (17, 768)])
def test_triton_activation_quantizer_matches_quantize_rows(
    dtype: torch.dtype, rows: int, cols: int
) -> None:
    from v1.quantization.fp8_rows import quantize_activations

    gen = torch.Generator().manual_seed(rows + cols)
    wide = (torch.randn(rows, 2 * cols, generator=gen) * 3).to("cuda", dtype)
    x = wide[:, :cols]  # strided rows, as a fused projection's chunk
    x[0] = 0  # an all-zero row keeps the minimum scale
    q, scale = quantize_activations(x)
    q_ref, scale_ref = quantize_rows(x)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # Same value, or one fp8 step where the division rounds differently.
    diff = (q.float() - q_ref.float()).abs()
    assert float((diff / q_ref.float().abs().clamp(min=2**-6)).max()) <= 0.13
    assert float((diff > 0).float().mean()) < 1e-3


# ---- real models against float32 ----


def _words(text: str) -> list[str]:
    text = text.lower().replace("mr.", "mister")
    return re.sub(r"[^a-z0-9' ]", " ", text).split()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER in percent: word-level edit distance over reference words."""
    errors = total = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        r, h = _words(ref), _words(hyp)
        row = list(range(len(h) + 1))
        for i, rw in enumerate(r, 1):
            prev, row[0] = row[0], i
            for j, hw in enumerate(h, 1):
                prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (rw != hw))
        errors += row[-1]
        total += len(r)
    return 100.0 * errors / total


def is_fp8(layer: torch.nn.Module) -> bool:
    return layer.weight.dtype == FP8_DTYPE and isinstance(layer.quant_method, Fp8LinearMethod)


def is_unquantized(layer: torch.nn.Module) -> bool:
    return layer.weight.dtype == torch.float32 and layer.quant_method is None


@pytest.mark.slow
@pytest.mark.skipif(
    not (WHISPER_BASE / "model.safetensors").is_file() or not AUDIO.is_dir(),
    reason="needs whisper-base's weights and the clips",
)
def test_real_whisper_base_fp8_default_recipe_keeps_the_fp32_word_error_rate() -> None:
    """The default recipe (encoder layers 2+ and the cross-attention K/V projections in fp8):
    WER within 0.5 points of float32 on the shared clips, i.e. not one of their 40 words moves
    (quantizing every Linear turns "Quilter's", 0.21 nats ahead in float32, into "Kultur's")."""
    from v1 import LLM
    from v1.audio import load_audio

    expected = json.loads((AUDIO / "expected_whisper_base.json").read_text())
    references = [(AUDIO / Path(n).with_suffix(".txt")).read_text().strip() for n in CLIPS]
    with LLM(
        str(WHISPER_BASE),
        device="cpu",
        multiprocess=False,
        quantization="fp8",
        max_num_encoder_input_tokens=3 * 1500,
    ) as llm:
        model = runner_of(llm.llm_engine.engine_core.engine_core).model
        encoder, decoder = model.model.encoder.layers, model.model.decoder.layers
        assert all(is_unquantized(m) for m in (encoder[0].fc1, encoder[1].self_attn.out_proj))
        assert all(is_fp8(layer.fc1) and is_fp8(layer.self_attn.qkv_proj) for layer in encoder[2:])
        assert all(is_fp8(layer.encoder_attn.kv_proj) for layer in decoder)
        assert all(is_unquantized(layer.fc2) for layer in decoder)
        prompts = [
            {
                "prompt": "",
                "multi_modal_data": {"audio": (load_audio(AUDIO / n), 16_000)},
                "language": "en",
            }
            for n in CLIPS
        ]
        params = SamplingParams(temperature=0.0, max_tokens=None)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    fp8_texts = [o.outputs[0].text for o in outputs]
    fp32_texts = [expected[n]["text"] for n in CLIPS]
    wer_fp32 = word_error_rate(references, fp32_texts)
    wer_fp8 = word_error_rate(references, fp8_texts)
    assert wer_fp8 <= wer_fp32 + 0.5, (fp8_texts, wer_fp8, wer_fp32)


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs all-MiniLM-L6-v2")
def test_minilm_fp8_default_recipe_keeps_cosine_to_fp32() -> None:
    """The default recipe (encoder layers 0-1 of 6 in fp8): cosine >= 0.999 to float32
    (quantizing every Linear gives 0.997-0.998)."""
    from v1 import LLM

    texts = [
        "The new movie is awesome",
        "The new movie is so great",
        "A monkey is playing drums.",
        "A man is playing a guitar in the park at night.",
        "I love pasta",
        "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    ]
    embeddings = {}
    for quantization in (None, "fp8"):
        with LLM(str(MINILM), device="cpu", multiprocess=False, quantization=quantization) as llm:
            if quantization == "fp8":
                layers = runner_of(llm.llm_engine.engine_core.engine_core).model.encoder.layer
                assert all(is_fp8(layer.intermediate.dense) for layer in layers[:2])
                assert all(is_unquantized(layer.intermediate.dense) for layer in layers[2:])
            embeddings[quantization] = np.array(
                [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
            )
    fp32, fp8 = embeddings[None], embeddings["fp8"]
    cosine = (fp32 * fp8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(fp8, axis=1)
    assert cosine.min() >= 0.999, cosine  # measured 0.9995-0.9997
    assert cosine.max() < 1.0 - 1e-6, "nothing was quantized"
    # The README's similarity (0.89392 in float32) moves by less than 0.005 (measured 0.0025).
    assert float(fp32[0] @ fp32[1]) == pytest.approx(0.89392, abs=1e-4)
    assert float(fp8[0] @ fp8[1]) == pytest.approx(0.89392, abs=0.005)


# ---- checkpoints already in fp8 ----


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart_dir(tmp_path_factory.mktemp("bart"))


def _is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return (
        name.endswith("_proj.weight") or re.search(r"\.fc[12]\.weight$", name) is not None
    ) and tensor.dim() == 2


def write_fp8_checkpoint(
    src: str, dst: Path, scheme: str, ignore: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """A copy of the tiny BART with its Linear weights in fp8, as quantization tools save them:
    compressed-tensors per channel (scale [N, 1]), quant_method "fp8" per tensor (scalar scale
    and a static input_scale) or block-wise (weight_scale_inv of 16x16 blocks). Returns the
    source tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.suffix != ".safetensors":
            (dst / item.name).write_bytes(item.read_bytes())
    state = load_file(str(Path(src) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not _is_linear_weight(name, tensor) or name.removesuffix(".weight") in ignore:
            out[name] = tensor
            continue
        base = name.removesuffix(".weight")
        if scheme == "channel":
            q, scale = quantize_rows(tensor)
            out[name], out[f"{base}.weight_scale"] = q, scale[:, None]
        elif scheme == "tensor":
            scale = tensor.abs().max().float() / FP8_MAX
            out[name] = (tensor / scale).to(FP8_DTYPE)
            out[f"{base}.weight_scale"] = scale.reshape(())
            out[f"{base}.input_scale"] = torch.tensor(0.02)
        else:
            n, k = tensor.shape
            blocks = tensor.reshape(n // 16, 16, k // 16, 16)
            scale = blocks.abs().amax(dim=(1, 3)).float() / FP8_MAX
            q = (blocks / scale[:, None, :, None]).to(FP8_DTYPE).reshape(n, k)
            out[name], out[f"{base}.weight_scale_inv"] = q, scale
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if scheme == "channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token"},
                }
            },
            "ignore": ["lm_head", *ignore],
        }
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
        if scheme == "block":
            config["quantization_config"]["weight_block_size"] = [16, 16]
    (dst / "config.json").write_text(json.dumps(config))
    return state


def generate(core: EngineCore, n: int = 4) -> dict[str, tuple[list[int], list[list[float]]]]:
    requests = [decoder_request(i, dec, enc) for i, (enc, dec) in enumerate(bart_inputs(n))]
    results: dict[str, Any] = {r.request_id: ([], []) for r in requests}
    for request in requests:
        request.sampling_params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
        core.add_request(request)
    while core.has_work():
        for out in core.step().outputs:
            results[out.request_id][0].extend(out.new_token_ids)
            results[out.request_id][1].extend(out.new_logprobs or [])
    assert core.get_stats()["num_used_blocks"] == 0
    return results


def test_compressed_tensors_per_channel_checkpoint_is_the_fp8_quantized_model(
    bart_dir: str, tmp_path: Path
) -> None:
    write_fp8_checkpoint(bart_dir, tmp_path / "ct", "channel")
    ours = make_core(str(tmp_path / "ct"))
    reference = make_core(bart_dir, quantization="fp8", fp8_ignore=[])  # every Linear, as the file
    for a, b in zip(
        runner_of(ours).model.named_parameters(),
        runner_of(reference).model.named_parameters(),
        strict=True,
    ):
        assert a[0] == b[0] and a[1].dtype == b[1].dtype, a[0]
        torch.testing.assert_close(a[1].float(), b[1].float(), atol=0, rtol=1e-6)
    assert generate(ours) == generate(reference)


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_per_tensor_and_block_wise_checkpoints_load_their_weights(
    bart_dir: str, tmp_path: Path, scheme: str
) -> None:
    """Their weights come back per channel: within one fp8 rounding of what the checkpoint
    holds (exactly it where the row maximum sits on the fp8 grid)."""
    from v1.quantization.fp8_checkpoint import dequantize_weight

    write_fp8_checkpoint(bart_dir, tmp_path / scheme, scheme)
    stored = load_file(str(tmp_path / scheme / "model.safetensors"))
    core = make_core(str(tmp_path / scheme))
    fc1 = runner_of(core).model.model.decoder.layers[0].fc1
    assert fc1.weight.dtype == FP8_DTYPE and fc1.weight_scale.shape == (fc1.output_size,)
    base = "model.decoder.layers.0.fc1"
    scale = stored.get(f"{base}.weight_scale", stored.get(f"{base}.weight_scale_inv"))
    block = (16, 16) if scheme == "block" else None
    theirs = dequantize_weight(stored[f"{base}.weight"], scale, block)
    ours = dequantize_rows(fc1.weight, fc1.weight_scale, torch.float32)
    row_max = theirs.abs().amax(dim=1, keepdim=True)
    assert float(((ours - theirs).abs() / row_max).max()) <= 2**-4
    assert not torch.equal(ours, theirs) or scheme == "tensor"
    tokens = generate(core)
    assert all(len(t) == 6 for t, _ in tokens.values())


def test_layers_the_checkpoint_keeps_in_high_precision_stay_so(
    bart_dir: str, tmp_path: Path
) -> None:
    kept = "model.decoder.layers.1.fc2"
    write_fp8_checkpoint(bart_dir, tmp_path / "ct", "channel", ignore=(kept,))
    model = runner_of(make_core(str(tmp_path / "ct"))).model
    assert model.model.decoder.layers[1].fc2.weight.dtype == torch.float32
    assert model.model.decoder.layers[1].fc2.quant_method is None
    assert model.model.decoder.layers[0].fc2.weight.dtype == FP8_DTYPE
    # A fused layer gets every shard from fp8 tensors: quantized as a whole.
    assert model.model.decoder.layers[1].self_attn.qkv_proj.weight.dtype == FP8_DTYPE


def test_unreadable_fp8_checkpoints_are_refused(bart_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "bad"
    write_fp8_checkpoint(bart_dir, path, "channel")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only 8-bit float"):
        make_core(str(path))
    config["quantization_config"] = {"quant_method": "awq"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported checkpoint quantization 'awq'"):
        make_core(str(path))
    write_fp8_checkpoint(bart_dir, path, "channel")
    state = load_file(str(path / "model.safetensors"))
    del state["model.decoder.layers.0.fc1.weight_scale"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="do not pair up"):
        make_core(str(path))


def test_quantization_name_is_validated(bart_dir: str) -> None:
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        make_core(bart_dir, quantization="int4")


def test_absorbed_cross_attention_reads_fp8_projections(bart_dir: str) -> None:
    """fp8 K/V projection weights fold their scales into the absorbed query and values: the
    same logits as per-layer K/V projected (without activation quantization) through the
    dequantized weights. Only the cross K/V projections are fp8 here: an fp8 layer after the
    attention would turn the two paths' float32 rounding differences into different fp8
    roundings of its input."""
    only_kv = [r"re:(?!.*encoder_attn\.kv_proj$).*"]
    absorbed_core = make_core(
        bart_dir, quantization="fp8", fp8_ignore=only_kv, cross_attention="absorbed"
    )
    decoder = runner_of(absorbed_core).model.model.decoder
    kv_proj = decoder.layers[0].encoder_attn.kv_proj
    assert kv_proj.weight.dtype == FP8_DTYPE
    # Absorbed multiplies per token with W_k, W_v: dequantized once, not every step.
    assert torch.equal(
        kv_proj.absorbed_weight,
        dequantize_rows(kv_proj.weight, kv_proj.weight_scale, torch.float32),
    )
    assert decoder.layers[0].encoder_attn.out_proj.weight.dtype == torch.float32
    reference_core = make_core(
        bart_dir, quantization="fp8", fp8_ignore=only_kv, cross_attention="per_layer"
    )
    for layer in runner_of(reference_core).model.model.decoder.layers:
        proj = layer.encoder_attn.kv_proj
        assert getattr(proj, "absorbed_weight", None) is None  # per_layer: the fp8 GEMM
        weight = dequantize_rows(proj.weight, proj.weight_scale, torch.float32)
        proj.weight = torch.nn.Parameter(weight, requires_grad=False)
        proj.quant_method = None
    absorbed, reference = generate(absorbed_core), generate(reference_core)
    for req_id, (tokens, logprobs) in absorbed.items():
        assert tokens == reference[req_id][0]
        for a, b in zip(logprobs, reference[req_id][1], strict=True):
            assert a == pytest.approx(b, abs=1e-4)


def test_fp8_mlp_takes_its_gelu_in_the_input_quantizer() -> None:
    from v1.models.layers.activation import GELU, gelu_mlp
    from v1.models.layers.linear import ColumnLinear, RowLinear

    gen = torch.Generator().manual_seed(5)
    fc1, fc2 = ColumnLinear(16, 64, bias=True), RowLinear(64, 16, bias=True)
    with torch.no_grad():
        for layer in (fc1, fc2):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.3)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    quantize_model_fp8(fc2)
    x = torch.randn(9, 16, generator=gen)
    torch.testing.assert_close(gelu_mlp(fc1, GELU(), fc2, x), fc2(GELU()(fc1(x))), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("epilogue", [True, False])
def test_triton_quantizer_applies_gelu_first(
    dtype: torch.dtype, epilogue: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tanh form of GELU, as the 16-bit GEMM epilogue; the erf form with
    V1_GELU_EPILOGUE=0."""
    from v1 import envs
    from v1.quantization.fp8_rows import quantize_activations

    monkeypatch.setattr(envs, "V1_GELU_EPILOGUE", epilogue)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(257, 5120, generator=gen) * 3).to("cuda", dtype)
    q, scale = quantize_activations(x, gelu=True)
    form = "tanh" if epilogue else "none"
    q_ref, scale_ref = quantize_rows(torch.nn.functional.gelu(x, approximate=form))
    torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)
    diff = (q.float() * scale[:, None] - q_ref.float() * scale_ref[:, None]).abs()
    assert float((diff / (q_ref.float() * scale_ref[:, None]).abs().clamp(min=1e-2)).max()) < 0.15


# ---- unscaled products (`Fp8Product`): out_proj, fc1 and fc2 of pre-norm encoder layers ----


def _product(rows: int, cols: int, device: str, dtype: torch.dtype, seed: int = 0) -> Fp8Product:
    gen = torch.Generator().manual_seed(seed)
    out = (torch.randn(rows, cols, generator=gen) * 2).to(device, dtype)
    row_scale = (torch.rand(rows, generator=gen) + 0.5).to(device)
    col_scale = (torch.rand(cols, generator=gen) + 0.5).to(device)
    return Fp8Product(out, row_scale, col_scale)


def test_fp8_product_reference_semantics() -> None:
    """What the fused kernels are held to: the product scaled by rows and columns (plus a
    bias) in float32, rounded once; add + LayerNorm of a product adds `residual_bias` to the
    residual stream only; the GELU quantizer quantizes GELU of the dequantized product."""
    from v1.models.layers.norm import LayerNorm, add_layer_norm
    from v1.quantization.fp8_rows import quantize_activations

    p = _product(6, 32, "cpu", torch.float32)
    bias = torch.randn(32)
    expected = p.out * p.row_scale[:, None] * p.col_scale[None, :] + bias
    torch.testing.assert_close(p.dequantize(bias), expected, rtol=1e-6, atol=1e-6)
    assert p.dtype == torch.float32
    norm = LayerNorm(32)
    residual = torch.randn(6, 32)
    out, h = add_layer_norm(p, residual, norm, residual_bias=bias)
    torch.testing.assert_close(out, norm(p.dequantize() + residual), rtol=0, atol=0)
    torch.testing.assert_close(h, p.dequantize() + residual + bias, rtol=0, atol=0)
    q, scale = quantize_activations(p, gelu=True, bias=bias)
    q_ref, scale_ref = quantize_rows(torch.nn.functional.gelu(p.dequantize(bias)))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernels_scale_products_and_add_biases(dtype: torch.dtype) -> None:
    """The GELU quantizer and add + LayerNorm with an `Fp8Product` input (and fc1's bias,
    out_proj's residual bias) against the torch reference of the same values."""
    from v1.models.layers.norm import LayerNorm, add_layer_norm
    from v1.quantization.fp8_rows import quantize_activations

    p = _product(4099, 5120, "cuda", dtype)
    bias = torch.randn(5120, device="cuda").to(dtype)
    q, scale = quantize_activations(p, gelu=True, bias=bias)
    ref = torch.nn.functional.gelu(p.dequantize(bias), approximate="tanh")
    q_ref, scale_ref = quantize_rows(ref)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)
    # The GPU's tanh instruction moves a 16-bit GELU value by a step now and then (often in
    # bfloat16's 8-bit mantissa), and such a value may round to the next fp8 step.
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    assert float(same.float().mean()) >= (0.999 if dtype == torch.float16 else 0.97)
    back, back_ref = q.float() * scale[:, None], q_ref.float() * scale_ref[:, None]
    assert float(((back - back_ref).abs() / back_ref.abs().clamp(min=1e-2)).max()) < 0.15

    p = _product(4099, 1280, "cuda", dtype, seed=1)
    norm = LayerNorm(1280).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        norm.bias.normal_(0, 0.1)
    residual = torch.randn(4099, 1280, device="cuda").to(dtype) * 4
    out_bias = torch.randn(1280, device="cuda").to(dtype)
    out, h = add_layer_norm(p, residual, norm, clamp=30.0, residual_bias=out_bias)
    x = p.dequantize()
    h_ref = (x + residual).clamp(-30.0, 30.0)
    torch.testing.assert_close(out, norm(h_ref), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h, h_ref + out_bias, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_encoder_hands_over_unscaled_products_on_gpu() -> None:
    """A pre-norm fp16 Whisper encoder quantized to fp8 on the GPU: out_proj, fc1 and fc2 hand
    over `Fp8Product`s (their consumers scale them and add the biases). Its output is as close
    to the 16-bit encoder's as the row-wise-scaled fp8 path's (every `unscaled_output` off):
    the two differ only where a value lands on the other side of an fp8 rounding step."""
    from transformers import WhisperForConditionalGeneration as HFWhisper

    from v1.attention.selector import use_backend
    from v1.forward_context import set_forward_context
    from v1.worker.model_loader import load_model_from_weights

    torch.manual_seed(0)
    cfg = small_whisper_config(3)
    hf = HFWhisper(cfg).to(torch.float16)
    with use_backend("triton"):
        ours = load_model_from_weights(cfg, hf.state_dict().items(), "cuda", torch.float16)
    del hf
    layers = ours.model.encoder.layers
    unscaled = [m for layer in layers for m in (layer.self_attn.out_proj, layer.fc1, layer.fc2)]
    context = uniform_encoder_context(ours, 3, 1500)
    features = torch.randn(3, 80, 3000, device="cuda")

    def encode() -> torch.Tensor:
        with torch.inference_mode(), set_forward_context(context):
            return ours.model.encoder(features).float()

    reference = encode()  # 16-bit
    quantize_model_fp8(ours.model.encoder)
    assert all(m.unscaled_output for m in unscaled)
    products = encode()
    for m in unscaled:
        m.unscaled_output = False
    scaled = encode()

    def err(x: torch.Tensor) -> float:
        return float((x - reference).norm() / reference.norm())

    assert 0 < err(products) < 0.1
    assert err(products) <= 1.25 * err(scaled), (err(products), err(scaled))
