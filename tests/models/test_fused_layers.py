"""The fused layer paths: residual add + LayerNorm (one Triton kernel on CUDA) and GELU as a
GEMM epilogue, against their unfused torch references; and equal-length encoder batches taking
cuDNN attention. The CPU tests pin the reference semantics the GPU kernels are held to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.harness import small_whisper_config, uniform_encoder_context
from v1.models.layers.activation import GELU, linear_act
from v1.models.layers.linear import ColumnLinear
from v1.models.layers.norm import LayerNorm, add_layer_norm, fp16_clamp_limit

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _norm(d: int, device: str, dtype: torch.dtype, seed: int = 0) -> LayerNorm:
    g = torch.Generator().manual_seed(seed)
    norm = LayerNorm(d, eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    assert norm.bias is not None
    norm.bias.copy_(0.1 * torch.randn(d, generator=g))
    return norm


def _linear(d_in: int, d_out: int, device: str, dtype: torch.dtype) -> ColumnLinear:
    g = torch.Generator().manual_seed(1)
    layer = ColumnLinear(d_in, d_out, bias=True).to(device=device, dtype=dtype)
    layer.weight.copy_(torch.randn(d_out, d_in, generator=g) * d_in**-0.5)
    assert layer.bias is not None
    layer.bias.copy_(0.1 * torch.randn(d_out, generator=g))
    return layer


def test_add_layer_norm_reference_semantics() -> None:
    x, r = torch.randn(5, 8), torch.randn(5, 8)
    r[0, 0] = 1e6
    norm = _norm(8, "cpu", torch.float32)
    out, h = add_layer_norm(x, r, norm, clamp=100.0)
    expected_h = (x + r).clamp(-100.0, 100.0)
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(expected_h), rtol=0, atol=0)
    out2, h2 = add_layer_norm(x, r, norm, store_residual=False)
    assert h2 is None
    torch.testing.assert_close(out2, norm(x + r), rtol=0, atol=0)
    assert fp16_clamp_limit(torch.float16) == torch.finfo(torch.float16).max - 1000
    assert fp16_clamp_limit(torch.bfloat16) is None


def test_linear_act_is_exact_off_cuda() -> None:
    layer, act = _linear(16, 32, "cpu", torch.float32), GELU()
    x = torch.randn(7, 16)
    torch.testing.assert_close(linear_act(layer, act, x), act(layer(x)), rtol=0, atol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "d"), [(4096, 1280), (5003, 768), (2048, 384)])
def test_fused_add_layer_norm_matches_torch(dtype: torch.dtype, rows: int, d: int) -> None:
    torch.manual_seed(0)
    norm = _norm(d, "cuda", dtype)
    fused_in = torch.randn(rows, 3 * d, device="cuda", dtype=dtype)
    x = fused_in[:, d : 2 * d]  # strided rows, as a fused projection's chunk
    r = torch.randn(rows, d, device="cuda", dtype=dtype) * 4
    clamp = 10.0
    out, h = add_layer_norm(x, r, norm, clamp=clamp)
    expected_h = (x + r).clamp(-clamp, clamp)
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out, norm(expected_h), rtol=tol, atol=tol)
    out2, none = add_layer_norm(x, r, norm, store_residual=False)
    assert none is None
    torch.testing.assert_close(out2, norm(x + r), rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "d"), [(4096, 1280), (5003, 768)])
def test_fused_add_layer_norm_quantizes_its_output_for_fp8_linears(
    dtype: torch.dtype, rows: int, d: int
) -> None:
    """`fp8_output`: the kernel's fp8 rows and scales are quantize_rows of the normed rows in
    16 bits, and the residual stream is unchanged. Compared with a separate launch of the
    16-bit kernel, whose compiled arithmetic may round a few elements one step apart: scales
    within a 16-bit step, values within an fp8 step, and nearly every byte the same."""
    from v1.quantization.fp8_rows import Fp8Rows, quantize_rows

    torch.manual_seed(0)
    norm = _norm(d, "cuda", dtype)
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    r = torch.randn(rows, d, device="cuda", dtype=dtype) * 4
    out, h = add_layer_norm(x, r, norm, clamp=10.0)
    norm.fp8_output = True
    rows_q, h_q = add_layer_norm(x, r, norm, clamp=10.0)
    assert isinstance(rows_q, Fp8Rows) and rows_q.dtype == dtype
    torch.testing.assert_close(h_q, h, rtol=0, atol=0)
    q, scale = quantize_rows(out)
    torch.testing.assert_close(rows_q.scale, scale, rtol=2**-7, atol=0)
    back = rows_q.q.float() * rows_q.scale[:, None]
    bound = (2**-4 + 2**-7) * out.float().abs() + rows_q.scale[:, None] * 2**-9
    assert bool(((back - out.float()).abs() <= bound).all())
    same = rows_q.q.view(torch.uint8) == q.view(torch.uint8)
    assert float(same.float().mean()) >= 0.999


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_epilogue_matches_unfused(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer, act = _linear(768, 3072, "cuda", dtype), GELU()
    x = torch.randn(4096, 768, device="cuda", dtype=dtype)
    fused = linear_act(layer, act, x).float()
    exact = F.gelu(F.linear(x.float(), layer.weight.float(), layer.bias.float()))
    # The epilogue's tanh form is within a 16-bit rounding step of erf GELU.
    step = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(fused, exact, rtol=step, atol=step)


@requires_cuda
@pytest.mark.gpu
def test_equal_length_encoder_batch_takes_cudnn_attention(monkeypatch) -> None:
    from v1.attention.backend import AttentionType, CommonAttentionMetadata
    from v1.attention.backends import triton as triton_backend

    def no_varlen(*args, **kwargs):
        raise AssertionError("equal-length batch went to flash varlen")

    monkeypatch.setattr(triton_backend.TritonImpl, "_varlen_forward", no_varlen)
    b, length, heads, dim = 4, 1500, 20, 64
    qsl = torch.arange(0, (b + 1) * length, length, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(),
        query_start_loc_cpu=qsl,
        seq_lens=torch.full((b,), length, dtype=torch.int32, device="cuda"),
        seq_lens_cpu=torch.full((b,), length, dtype=torch.int32),
        num_reqs=b,
        num_actual_tokens=b * length,
        max_query_len=length,
        max_seq_len=length,
        causal=False,
    )
    builder = triton_backend.TritonMetadataBuilder(AttentionType.ENCODER, torch.device("cuda"), 16)
    metadata = builder.build(common)
    assert metadata.uniform_query_len == length
    impl = triton_backend.TritonImpl(heads, dim, dim**-0.5, heads, AttentionType.ENCODER)
    qkv = torch.randn(b * length, 3, heads, dim, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    out = impl.forward(q, k, v, torch.empty(0), metadata)
    dense = [t.view(b, length, heads, dim).transpose(1, 2).float() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*dense).transpose(1, 2).reshape(b * length, heads, dim)
    torch.testing.assert_close(out.float(), ref, rtol=5e-3, atol=5e-3)


@requires_cuda
@pytest.mark.gpu
def test_whisper_encoder_with_fused_paths_matches_transformers() -> None:
    """Four 30 s windows (6,000 rows: the fused add + LayerNorm, the GELU epilogue and cuDNN
    attention all run) through our fp16 encoder and transformers' on the same weights."""
    from transformers import WhisperForConditionalGeneration as HFWhisper

    from v1.attention.selector import use_backend
    from v1.forward_context import set_forward_context
    from v1.worker.model_loader import load_model_from_weights
    from v1.worker.model_states.encoder_decoder import _audio_to_device

    torch.manual_seed(0)
    cfg = small_whisper_config(4)
    hf = HFWhisper(cfg).to("cuda", torch.float16).eval()
    with use_backend("triton"):
        ours = load_model_from_weights(cfg, hf.state_dict().items(), "cuda", torch.float16)
    rng = torch.Generator().manual_seed(1)
    clips = [(torch.randn(480_000, generator=rng) * 0.1).numpy() for _ in range(4)]
    audio = _audio_to_device(clips, torch.device("cuda"))
    context = uniform_encoder_context(ours, 4, 1500)
    assert len(context.attn_metadata) == 4  # one entry per encoder layer
    with torch.inference_mode(), set_forward_context(context):
        features = ours.mel(audio)  # [4, 80, 3000] float32
        out = ours.model.encoder(features).float()
        expected = hf.model.encoder(features.half()).last_hidden_state.reshape(6000, -1).float()
    err = (out - expected).norm() / expected.norm()
    assert err < 5e-3, err
