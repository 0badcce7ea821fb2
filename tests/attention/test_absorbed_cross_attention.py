"""Absorbed cross-attention against per-layer attention on named shapes: the query projected by
W_k attends over the paged encoder output E, then W_v and b_v apply; it must equal attention over
K = E W_k^T + b_k, V = E W_v^T + b_v (b_k cancels). The torch reference runs on CPU, the Triton
kernel (GPU-marked) on CUDA; fp8 encoder states and fp8 weights against their dequantized values.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.attention.ops.absorbed_cross_attention import (
    CrossProjection,
    absorbed_cross_attention,
    write_encoder_states,
)
from v1.attention.ops.reference import naive_attention
from v1.attention.selector import load_backend
from v1.kv_cache.spec import FullAttentionSpec, encoder_states_spec_in_pool
from v1.quantization.fp8_rows import dequantize_rows, quantize_rows
from v1.worker.kv_cache_views import PoolLayout, encoder_states_views

CROSS = AttentionType.ENCODER_DECODER


@dataclass(frozen=True)
class AbsorbedShape:
    name: str
    query_lens: tuple[int, ...]
    encoder_lens: tuple[int, ...]
    num_heads: int = 4
    head_size: int = 16
    d_model: int = 64
    block_size: int = 16
    """Tokens per self-attention block (the encoder-states block holds its share of the page)."""
    num_pad_tokens: int = 0
    span: int = 1
    """Pool tensors (decoder layers) an encoder-states block spreads over."""


SHAPES = {
    s.name: s
    for s in [
        # Whisper-like decode: one token per request, 1500 encoder positions scaled to 75.
        AbsorbedShape("decode", (1,) * 6, (75, 75, 40, 1, 33, 75)),
        # The same, each states block spread over 3 pool tensors (3 decoder layers).
        AbsorbedShape("decode_span3", (1,) * 6, (75, 75, 40, 1, 33, 75), span=3),
        # First steps (Whisper's 3-4 prompt tokens) mixed with decodes, padded like a graph.
        AbsorbedShape("first_steps", (4, 1, 3, 1), (75, 75, 20, 64), num_pad_tokens=3),
        # BART-like prefill of longer decoder prompts over short encoder inputs.
        AbsorbedShape("prefill", (17, 5, 33), (12, 31, 7), num_heads=8, head_size=8),
        # T5-like: heads x head size (48) != d_model (64): padded states pages.
        AbsorbedShape("t5_inner", (1, 6, 1), (9, 50, 24), num_heads=6, head_size=8, block_size=8),
        # Large-v3-like proportions (20 heads x 64 = 1280 wide) scaled to 10 heads x 8 = 80.
        AbsorbedShape(
            "wide_heads", (1,) * 3 + (4,), (40, 40, 17, 40), num_heads=10, head_size=8, d_model=80
        ),
        # Large-v3's layout: blocks over 32 pool tensors, a request in two blocks or fewer.
        AbsorbedShape(
            "wide_span32", (1, 1, 4), (75, 40, 17), num_heads=10, head_size=8, d_model=80, span=32
        ),
    ]
}
NUM_SPARE_BLOCKS = 4


@dataclass
class AbsorbedBatch:
    query: torch.Tensor
    proj: CrossProjection
    states: torch.Tensor
    scales: torch.Tensor | None
    common: CommonAttentionMetadata
    block_size: int
    encoder_outputs: list[torch.Tensor]
    """Per request E [S, d] as written (before any fp8 rounding)."""


def make_absorbed_batch(
    shape: AbsorbedShape,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    fp8_states: bool = False,
    seed: int = 0,
) -> AbsorbedBatch:
    gen = torch.Generator().manual_seed(seed)
    heads, dim, d = shape.num_heads, shape.head_size, shape.d_model

    def randn(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).to(dtype).to(device)

    cache_dtype = "float8_e4m3fn" if fp8_states else str(dtype).removeprefix("torch.")
    pool_spec = FullAttentionSpec(shape.block_size, heads, dim, cache_dtype)
    spec = encoder_states_spec_in_pool(pool_spec, d, span=shape.span)
    block_size = spec.block_size
    blocks_per_req = [-(-n // block_size) for n in shape.encoder_lens]
    num_blocks = 1 + sum(blocks_per_req) + NUM_SPARE_BLOCKS
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    buffer = torch.zeros(
        shape.span * num_blocks * spec.page_size_bytes, dtype=torch.uint8, device=device
    )
    cache = encoder_states_views(buffer, spec, num_blocks, PoolLayout.of(pool_spec))
    # Poison every row: a read outside a request's own rows shows up as a wrong output.
    cache.values.copy_((torch.randn(cache.values.shape, generator=gen) * 30).to(cache.values.dtype))
    if cache.scales is not None:
        cache.scales.fill_(3.0)
    encoder_outputs, slots, table, start = [], [], [], 0
    for n, num in zip(shape.encoder_lens, blocks_per_req, strict=True):
        ids = perm[start : start + num]
        start += num
        table.append(ids + [0])  # a spare null column, as the runner's wider table has
        encoder_outputs.append(randn(n, d))
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    write_encoder_states(
        torch.cat(encoder_outputs),
        cache.values,
        cache.scales,
        torch.tensor(slots, dtype=torch.int64, device=device),
    )
    width = max(map(len, table))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in table], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(shape.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(shape.encoder_lens, dtype=torch.int32)
    num_tokens = sum(shape.query_lens)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_reqs=len(shape.query_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(shape.query_lens),
        max_seq_len=max(shape.encoder_lens),
        causal=False,
        block_table=block_table.to(device),
        query_positions=torch.cat([torch.arange(q) for q in shape.query_lens]).to(device),
    )
    proj = CrossProjection(
        weight=randn(2 * heads * dim, d, std=d**-0.5),
        weight_scale=None,
        bias=randn(2 * heads * dim, std=0.5),
        head_size=dim,
    )
    query = randn(num_tokens + shape.num_pad_tokens, heads * dim)
    return AbsorbedBatch(
        query, proj, cache.values, cache.scales, common, block_size, encoder_outputs
    )


def per_layer_reference(
    batch: AbsorbedBatch, shape: AbsorbedShape, encoder_outputs: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Per request: K/V projected from E (biases included), plain attention -> [T, H * D]."""
    heads, dim = shape.num_heads, shape.head_size
    weight = batch.proj.weight.float()
    if batch.proj.weight_scale is not None:
        weight = weight * batch.proj.weight_scale[:, None]
    w_k, w_v = weight.chunk(2)
    b_k, b_v = batch.proj.bias.float().chunk(2)
    outs, start = [], 0
    for r, num_q in enumerate(shape.query_lens):
        e = (encoder_outputs or batch.encoder_outputs)[r].float()
        k = (e @ w_k.T + b_k).view(-1, heads, dim)
        v = (e @ w_v.T + b_v).view(-1, heads, dim)
        q = batch.query[start : start + num_q].float().view(num_q, heads, dim)
        outs.append(naive_attention(q, k, v, dim**-0.5, causal=False).reshape(num_q, -1))
        start += num_q
    return torch.cat(outs)


def run_absorbed(batch: AbsorbedBatch, shape: AbsorbedShape, backend: str) -> torch.Tensor:
    device = batch.query.device
    builder = load_backend(backend).get_builder_cls()(CROSS, device, batch.block_size)
    metadata = builder.build(batch.common)
    out = absorbed_cross_attention(
        batch.query,
        batch.proj,
        batch.states,
        batch.scales,
        metadata,
        shape.num_heads,
        shape.head_size**-0.5,
    )
    assert out.shape == batch.query.shape
    return out[: batch.common.num_actual_tokens]


BACKENDS = [
    pytest.param("torch_sdpa", id="torch"),
    pytest.param(
        "triton",
        id="triton",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def device_of(backend: str) -> str:
    return "cuda" if backend == "triton" else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_absorbed_equals_per_layer_attention(backend: str, shape_name: str) -> None:
    shape = SHAPES[shape_name]
    batch = make_absorbed_batch(shape, device_of(backend), seed=1)
    out = run_absorbed(batch, shape, backend)
    torch.testing.assert_close(out, per_layer_reference(batch, shape), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_name", ["decode", "t5_inner"])
def test_absorbed_bfloat16_is_close(backend: str, shape_name: str) -> None:
    shape = SHAPES[shape_name]
    batch = make_absorbed_batch(shape, device_of(backend), dtype=torch.bfloat16, seed=2)
    out = run_absorbed(batch, shape, backend).float()
    torch.testing.assert_close(out, per_layer_reference(batch, shape), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape_name", ["decode", "first_steps", "t5_inner"])
def test_fp8_encoder_states_dequantize_inside_attention(backend: str, shape_name: str) -> None:
    shape = SHAPES[shape_name]
    batch = make_absorbed_batch(shape, device_of(backend), fp8_states=True, seed=3)
    assert batch.states.dtype == torch.float8_e4m3fn and batch.scales is not None
    out = run_absorbed(batch, shape, backend)
    # Exact against the rows the cache holds (E rounded to fp8 with its per-row scale)...
    rounded = [dequantize_rows(*quantize_rows(e), torch.float32) for e in batch.encoder_outputs]
    torch.testing.assert_close(
        out, per_layer_reference(batch, shape, rounded), atol=2e-5, rtol=2e-5
    )
    # ... and close to full precision.
    torch.testing.assert_close(out, per_layer_reference(batch, shape), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_projection_weights_fold_their_scales(backend: str) -> None:
    shape = SHAPES["first_steps"]
    batch = make_absorbed_batch(shape, device_of(backend), seed=4)
    weight, weight_scale = quantize_rows(batch.proj.weight)
    batch.proj = CrossProjection(weight, weight_scale, batch.proj.bias, shape.head_size)
    out = run_absorbed(batch, shape, backend)
    torch.testing.assert_close(out, per_layer_reference(batch, shape), atol=2e-5, rtol=2e-5)


def test_k_bias_cancels_and_v_bias_is_added_once() -> None:
    shape = SHAPES["decode"]
    batch = make_absorbed_batch(shape, seed=5)
    base = run_absorbed(batch, shape, "torch_sdpa")
    b_k, b_v = batch.proj.bias.chunk(2)
    for new_bias, delta in ((torch.cat([b_k + 7.0, b_v]), 0.0), (torch.cat([b_k, b_v + 1.5]), 1.5)):
        batch.proj = CrossProjection(batch.proj.weight, None, new_bias, shape.head_size)
        torch.testing.assert_close(run_absorbed(batch, shape, "torch_sdpa"), base + delta)


CUDA_SHAPES = [
    *SHAPES,
    # More than 16 heads (32-row tiles) at a small width, with a multi-token first step.
    "many_heads",
    # Whisper large-v3's real width: 20 heads x 64 = d 1280 (8 warps x 160 columns), blocks
    # over 32 pool tensors: a full 1500-position request, shorter ones, a 4-token first step.
    "large_v3",
]
MANY_HEADS = AbsorbedShape(
    "many_heads", (1, 3, 1), (40, 17, 75), num_heads=20, head_size=4, d_model=80, span=3
)
LARGE_V3 = AbsorbedShape(
    "large_v3", (1, 4, 1, 1), (1500, 700, 1, 33), num_heads=20, head_size=64, d_model=1280, span=32
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8_states", [False, True], ids=["16bit_states", "fp8_states"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape_name", CUDA_SHAPES)
def test_cuda_kernel_matches_per_layer_and_triton(
    shape_name: str, dtype: torch.dtype, fp8_states: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NVRTC-compiled kernel runs (not a fallback) for 16-bit models over 16-bit or fp8
    states on every shape, and agrees with per-layer attention (over the rows the cache holds)
    and with the Triton kernel."""
    from v1.attention.ops.cuda_absorbed import KERNEL_ENV, kernel_for

    shape = {"large_v3": LARGE_V3, "many_heads": MANY_HEADS}.get(shape_name) or SHAPES[shape_name]
    batch = make_absorbed_batch(shape, "cuda", dtype=dtype, fp8_states=fp8_states, seed=6)
    assert kernel_for(batch.query.new_zeros(1, 20, shape.d_model), batch.states, batch.scales)
    out = run_absorbed(batch, shape, "triton").float()
    held = batch.encoder_outputs
    if fp8_states:  # E as the cache holds it: each row rounded to fp8 with its scale
        held = [dequantize_rows(*quantize_rows(e.float()), torch.float32) for e in held]
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(out, per_layer_reference(batch, shape, held), atol=tol, rtol=tol)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    torch.testing.assert_close(
        out, run_absorbed(batch, shape, "triton").float(), atol=tol, rtol=tol
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [MANY_HEADS, LARGE_V3], ids=lambda s: s.name)
def test_cuda_kernel_in_a_graph_loops_over_multi_token_rows(shape: AbsorbedShape) -> None:
    """Captured, the kernel gives a work item one block that loops over its row tiles (the
    rows are known on the device only): a replay with 3- and 4-token queries equals eager."""
    batch = make_absorbed_batch(shape, "cuda", dtype=torch.float16, seed=7)
    eager = run_absorbed(batch, shape, "triton")
    run_absorbed(batch, shape, "triton")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_absorbed(batch, shape, "triton")
    captured.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)


def test_cuda_kernel_plan_fits_shared_memory_and_declines_what_it_cannot_take() -> None:
    """The build plan (pure host logic, so it runs without a GPU): whole 16-column k-steps a
    warp, 32-row tiles past 16 heads, the first step shape that fits the device's shared
    memory, None for fp32 or odd widths."""
    from v1.attention.ops.cuda_absorbed import plan, warps_for

    assert [warps_for(d) for d in (1280, 1024, 768, 512, 384, 80, 64, 2048)] == [
        8,
        8,
        6,
        4,
        4,
        5,
        4,
        16,
    ]
    assert warps_for(72) is None and warps_for(4096) is None
    h100 = 227 * 1024
    large_v3 = plan(1280, torch.float16, 32, 16, 20, h100)  # 20 heads, one token
    assert large_v3 is not None and (large_v3.warps, large_v3.warp_columns) == (8, 160)
    assert (large_v3.m_tiles, large_v3.block_n, large_v3.stages) == (2, 16, 2)
    assert large_v3.smem_bytes <= h100
    bart = plan(1024, torch.float16, 12, 16, 16, h100)  # 16 heads: one 16-row tile
    assert (bart.m_tiles, bart.block_n, bart.stages) == (1, 32, 2)
    fp8 = plan(1280, torch.float16, 32, 16, 20, h100, fp8=True)  # half the bytes: 32 a step
    assert fp8.fp8 and (fp8.m_tiles, fp8.block_n, fp8.stages) == (2, 32, 2)
    assert fp8.smem_bytes <= h100 and "#define FP8 1" in fp8.source()
    assert plan(1280, torch.float16, 32, 16, 20, 100 * 1024) is None
    assert plan(1280, torch.float32, 32, 16, 20, h100) is None
    source = large_v3.source()
    assert "#define DW 160" in source and "#define M_TILES 2" in source
