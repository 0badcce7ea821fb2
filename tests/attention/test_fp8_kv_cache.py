"""fp8 KV caches on the named batch shapes, for every backend that supports them: rows written
this step are stored as float8_e4m3 with one float32 scale per token and head, nothing else is
written, and attention equals the naive reference over the dequantized rows (bias included).
"""

from __future__ import annotations

import pytest
import torch
from shapes import (
    DEC,
    SHAPES,
    Batch,
    LoadedBackend,
    make_batch,
    make_relative_bias,
    shape_type_cases,
)

from v1.attention.backend import AttentionType
from v1.attention.ops.reference import naive_attention
from v1.quantization.fp8_rows import FP8_DTYPE, dequantize_rows, quantize_rows

PAGED_CASES = [
    pytest.param(name, t, id=f"{name}-{t.value}")
    for name, t in shape_type_cases()
    if t.has_kv_cache
]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an fp8 cache gives it back."""
    return dequantize_rows(*quantize_rows(x), x.dtype)


def fp8_step(
    backend: LoadedBackend, batch: Batch, bias: object = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the batch's cache (poison and prior context), run one step; returns the
    output, the fp8 cache and its scales after the step."""
    if not backend.cls.capabilities.fp8_kv_cache:
        pytest.skip(f"{backend.cls.name} has no fp8 KV cache")
    shape = batch.shape
    cache, scales = quantize_rows(batch.kv_cache)  # [2, nb, bs, Hkv, D], [2, nb, bs, Hkv]
    builder = backend.cls.get_builder_cls()(batch.attn_type, backend.device, shape.block_size)
    impl = backend.cls.get_impl_cls()(
        shape.num_heads, shape.head_size, batch.scale, shape.num_kv_heads, batch.attn_type
    )
    metadata = builder.build(batch.common)
    out = impl.forward(batch.query, batch.key, batch.value, cache, metadata, bias, scales)
    return out, cache, scales


def tolerance(backend: LoadedBackend) -> float:
    # The torch reference quantizes exactly as the expectation does; a kernel may round a
    # tie or a division's last bit differently, moving one fp8 value by one step.
    return 1e-5 if backend.cls.name == "torch_sdpa" else 3e-2


@pytest.mark.parametrize(("shape_name", "attn_type"), PAGED_CASES)
def test_fp8_cache_attends_over_the_dequantized_rows(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=7)
    out, cache, scales = fp8_step(backend, batch)
    assert cache.dtype == FP8_DTYPE
    expected = torch.cat(
        [
            naive_attention(
                batch.queries(r),
                rounded(batch.keys[r]),
                rounded(batch.values[r]),
                batch.scale,
                batch.causal,
            )
            for r in range(batch.shape.num_reqs)
        ]
    )
    tol = tolerance(backend)
    torch.testing.assert_close(out[: batch.shape.num_tokens], expected, atol=tol, rtol=tol)
    # The cache holds exactly what a correct step writes (quantized), nothing more.
    stored = cache.float() * scales[..., None]
    torch.testing.assert_close(stored, rounded(batch.expected_kv_cache), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape_name", ["decode_long", "mixed"])
def test_fp8_cache_with_t5_relative_bias(backend: LoadedBackend, shape_name: str) -> None:
    batch = make_batch(SHAPES[shape_name], DEC, torch.float32, backend.device, seed=8)
    bias, per_req = make_relative_bias(batch, seed=9)
    out, _, _ = fp8_step(backend, batch, bias)
    expected = torch.cat(
        [
            naive_attention(
                batch.queries(r),
                rounded(batch.keys[r]),
                rounded(batch.values[r]),
                batch.scale,
                True,
                per_req[r],
            )
            for r in range(batch.shape.num_reqs)
        ]
    )
    tol = tolerance(backend)
    torch.testing.assert_close(out[: batch.shape.num_tokens], expected, atol=tol, rtol=tol)


def test_fp8_cache_is_close_to_full_precision() -> None:
    from v1.attention.selector import load_backend

    backend = LoadedBackend(load_backend("torch_sdpa"), torch.device("cpu"))
    batch = make_batch(SHAPES["mixed_gqa"], DEC, torch.float32, "cpu", seed=10)
    out, _, _ = fp8_step(backend, batch)
    torch.testing.assert_close(out[: batch.shape.num_tokens], batch.expected, atol=0.1, rtol=0.1)
