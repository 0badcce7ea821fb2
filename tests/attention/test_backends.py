"""Every attention backend against the naive per-request reference on the named batch shapes:
outputs, KV cache writes (and nothing else written), and additive bias (materialized and T5).

A GPU backend joins by adding its name to BACKEND_NAMES in conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from shapes import (
    CROSS,
    DEC,
    ENC,
    ENC_ONLY,
    SHAPES,
    Batch,
    LoadedBackend,
    make_batch,
    make_materialized_bias,
    make_relative_bias,
    shape_type_cases,
)

from v1.attention.backend import AttentionBias, AttentionType
from v1.attention.ops.reference import gather_kv


def run_step(
    backend: LoadedBackend,
    batch: Batch,
    bias: AttentionBias | None = None,
    kv_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """Build the backend's metadata for the batch and run one Impl.forward."""
    shape = batch.shape
    if batch.attn_type not in backend.cls.capabilities.attn_types:
        pytest.skip(f"{backend.cls.name} does not support {batch.attn_type.value}")
    if bias is not None and not backend.cls.capabilities.bias:
        pytest.skip(f"{backend.cls.name} does not support bias")
    builder = backend.cls.get_builder_cls()(batch.attn_type, backend.device, shape.block_size)
    metadata = builder.build(batch.common)
    impl = backend.cls.get_impl_cls()(
        shape.num_heads, shape.head_size, batch.scale, shape.num_kv_heads, batch.attn_type
    )
    cache = batch.kv_cache if kv_cache is None else kv_cache
    return impl.forward(batch.query, batch.key, batch.value, cache, metadata, bias)


CASES = [pytest.param(name, t, id=f"{name}-{t.value}") for name, t in shape_type_cases()]


@pytest.mark.parametrize(("shape_name", "attn_type"), CASES)
def test_output_matches_reference(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=1)
    batch.assert_output(run_step(backend, batch))


@pytest.mark.parametrize(
    ("shape_name", "attn_type"),
    [
        ("decode", DEC),
        ("mixed_gqa", DEC),
        ("encoder", ENC),
        ("encoder_uniform", ENC),
        ("encoder_uniform_padded", ENC_ONLY),
        ("cross", CROSS),
    ],
)
def test_output_matches_reference_bf16(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.bfloat16, backend.device, seed=2)
    batch.assert_output(run_step(backend, batch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape_name", ["encoder_only_bert", "encoder_only_minilm"])
def test_encoder_only_heads_in_16_bits(
    backend: LoadedBackend, shape_name: str, dtype: torch.dtype
) -> None:
    """The BERT-family shapes in 16 bits (the Triton backend's encoder-only kernel on a GPU),
    q/k/v strided views of one fused projection as the models hold them."""
    batch = make_batch(SHAPES[shape_name], ENC_ONLY, dtype, backend.device, seed=5)
    batch.query, batch.key, batch.value = _as_fused_views(batch)
    batch.assert_output(run_step(backend, batch))


@pytest.mark.parametrize(("shape_name", "attn_type"), CASES)
def test_kv_cache_writes_only_this_steps_slots(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=3)
    before = batch.kv_cache.clone()
    run_step(backend, batch)
    if attn_type.has_kv_cache:
        for r, block_ids in enumerate(batch.block_ids):
            k, v = gather_kv(batch.kv_cache, block_ids, len(batch.keys[r]))
            assert torch.equal(k, batch.keys[r]) and torch.equal(v, batch.values[r]), f"req {r}"
        # Every other row (null block, spare blocks, the tails of last blocks) is unchanged.
        assert torch.equal(batch.kv_cache, batch.expected_kv_cache)
        assert not torch.equal(batch.kv_cache, before) or batch.key is None
    else:
        assert torch.equal(batch.kv_cache, before)


@pytest.mark.parametrize("shape_name", ["prefill", "encoder", "encoder_only", "encoder_padded"])
def test_cacheless_types_run_with_an_empty_cache(backend: LoadedBackend, shape_name: str) -> None:
    shape = SHAPES[shape_name]
    batch = make_batch(shape, shape.attn_types[-1], torch.float32, backend.device, seed=4)
    assert batch.common.block_table is None and batch.common.slot_mapping is None
    out = run_step(backend, batch, kv_cache=torch.empty(0, device=backend.device))
    batch.assert_output(out)


def test_cross_read_only_step_reads_the_cache(backend: LoadedBackend) -> None:
    """A cross step with nothing to write attends to exactly the K/V in the cache."""
    batch = make_batch(SHAPES["cross_decode"], CROSS, torch.float32, backend.device, seed=5)
    assert batch.key is None and batch.value is None
    # Negate every cached row: the output must follow the cache.
    bs = batch.shape.block_size
    for r, block_ids in enumerate(batch.block_ids):
        for pos in range(len(batch.keys[r])):
            batch.kv_cache[:, block_ids[pos // bs], pos % bs] *= -1
    batch.keys = [-k for k in batch.keys]
    batch.values = [-v for v in batch.values]
    batch.assert_output(run_step(backend, batch), batch.reference())


# --- bias -----------------------------------------------------------------------------------

BIAS_CASES = [
    ("prefill", DEC),
    ("decode", DEC),
    ("mixed", DEC),
    ("mixed_padded", DEC),
    ("decode_long", DEC),
    ("prefill", ENC),
    ("encoder", ENC),
    ("prefill", ENC_ONLY),
    ("encoder_only", ENC_ONLY),
    ("cross_prefill", CROSS),
    ("cross_decode", CROSS),
    ("cross", CROSS),
]


@pytest.mark.parametrize("kind", ["materialized", "relative"])
@pytest.mark.parametrize(
    ("shape_name", "attn_type"), [pytest.param(n, t, id=f"{n}-{t.value}") for n, t in BIAS_CASES]
)
def test_bias_matches_reference(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType, kind: str
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=6)
    make_bias = make_materialized_bias if kind == "materialized" else make_relative_bias
    bias, per_req = make_bias(batch, seed=7)
    expected = batch.reference(per_req)
    # The bias must matter, or this test could not tell a backend that drops it.
    assert (expected - batch.expected).abs().max() > 1e-2
    batch.assert_output(run_step(backend, batch, bias), expected)


def _as_fused_views(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v as strided column slices of one fused projection, with k copied out (as RoPE
    does), so q, k and v all have different row strides."""
    q, k, v = batch.query, batch.key, batch.value
    fused = torch.cat([q.flatten(1), torch.zeros_like(q.flatten(1)[:, :8]), v.flatten(1)], dim=1)
    q_view = fused[:, : q[0].numel()].view(q.shape)
    v_view = fused[:, -v[0].numel() :].view(v.shape)
    assert q_view.stride(0) != k.stride(0) != v_view.stride(0)
    return q_view, k.clone(), v_view


@pytest.mark.parametrize(("shape_name", "attn_type"), [("mixed", DEC), ("encoder", ENC)])
def test_strided_inputs_from_a_fused_projection(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=9)
    batch.query, batch.key, batch.value = _as_fused_views(batch)
    batch.assert_output(run_step(backend, batch))
