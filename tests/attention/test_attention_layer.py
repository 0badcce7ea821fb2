"""The Attention layer: metadata looked up by layer name in the forward context, the
[T, H*D] <-> [T, H, D] reshapes on fused-projection views, its own KV cache, backend choice."""

from __future__ import annotations

import pytest
import torch
from shapes import CROSS, DEC, ENC, ENC_ONLY, SHAPES, Batch, LoadedBackend, make_batch

from v1.attention.backend import AttentionBias, AttentionType
from v1.attention.layer import Attention
from v1.attention.selector import use_backend
from v1.forward_context import ForwardContext, set_forward_context

PREFIX = "model.layers.0.self_attn.attn"


def make_layer(backend: LoadedBackend, batch: Batch, prefix: str = PREFIX) -> Attention:
    shape = batch.shape
    with use_backend(backend.cls.name):
        layer = Attention(
            shape.num_heads,
            shape.head_size,
            batch.scale,
            shape.num_kv_heads,
            batch.attn_type,
            prefix=prefix,
        )
    if batch.attn_type.has_kv_cache:
        layer.kv_cache = batch.kv_cache
    return layer


def build_metadata(backend: LoadedBackend, batch: Batch) -> object:
    builder_cls = backend.cls.get_builder_cls()
    builder = builder_cls(batch.attn_type, backend.device, batch.shape.block_size)
    return builder.build(batch.common)


def projections(
    batch: Batch, sign: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q/k/v as a model hands them over: [T, H*D] column slices of one fused projection (cross:
    query alone, K/V sliced from a fused encoder-side KV projection)."""
    q, k, v = batch.query.flatten(1), batch.key, batch.value
    if k is None:
        return q, None, None
    k, v = sign * k.flatten(1), sign * v.flatten(1)
    if batch.attn_type == CROSS:
        kv = torch.cat([k, v], dim=1)
        return (q, *kv.split([k.shape[1], v.shape[1]], dim=1))
    qkv = torch.cat([q, k, v], dim=1)
    return qkv.split([q.shape[1], k.shape[1], v.shape[1]], dim=1)  # strided views


def run_layer(
    layer: Attention,
    metadata: object,
    inputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    bias: AttentionBias | None = None,
) -> torch.Tensor:
    with set_forward_context(ForwardContext(attn_metadata={layer.layer_name: metadata})):
        return layer(*inputs, bias=bias)


LAYER_CASES = [
    ("mixed", DEC),
    ("mixed_padded", DEC),
    ("decode_mqa", DEC),
    ("encoder", ENC),
    ("encoder_padded", ENC_ONLY),
    ("cross", CROSS),
    ("cross_decode", CROSS),
    ("cross_gqa_padded", CROSS),
]


@pytest.mark.parametrize(
    ("shape_name", "attn_type"), [pytest.param(n, t, id=f"{n}-{t.value}") for n, t in LAYER_CASES]
)
def test_layer_reshapes_and_matches_reference(
    backend: LoadedBackend, shape_name: str, attn_type: AttentionType
) -> None:
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, backend.device, seed=11)
    layer = make_layer(backend, batch)
    assert layer.backend is backend.cls
    out = run_layer(layer, build_metadata(backend, batch), projections(batch))
    shape = batch.shape
    assert out.shape == (batch.query.shape[0], shape.num_heads * shape.head_size)
    batch.assert_output(out.view(batch.query.shape))
    if attn_type.has_kv_cache:
        assert torch.equal(layer.kv_cache, batch.expected_kv_cache)
    else:
        assert layer.kv_cache.numel() == 0


def test_layers_sharing_metadata_write_their_own_caches(backend: LoadedBackend) -> None:
    """Layers of one KV group share one metadata object; each writes only its own cache."""
    batch = make_batch(SHAPES["mixed"], DEC, torch.float32, backend.device, seed=12)
    first = make_layer(backend, batch, "model.layers.0.self_attn.attn")
    second = make_layer(backend, batch, "model.layers.1.self_attn.attn")
    second.kv_cache = -batch.kv_cache  # the second layer's context is the negated K/V
    metadata = build_metadata(backend, batch)
    context = ForwardContext(
        attn_metadata={first.layer_name: metadata, second.layer_name: metadata}
    )
    with set_forward_context(context):
        out_first = first(*projections(batch))
        out_second = second(*projections(batch, sign=-1.0))
    assert torch.equal(first.kv_cache, batch.expected_kv_cache)
    assert torch.equal(second.kv_cache, -batch.expected_kv_cache)
    batch.assert_output(out_first.view(batch.query.shape))
    batch.keys = [-k for k in batch.keys]
    batch.values = [-v for v in batch.values]
    batch.assert_output(out_second.view(batch.query.shape), batch.reference())


def test_layer_passes_bias_through(backend: LoadedBackend) -> None:
    from shapes import make_relative_bias

    batch = make_batch(SHAPES["mixed"], DEC, torch.float32, backend.device, seed=13)
    bias, per_req = make_relative_bias(batch, seed=14)
    layer = make_layer(backend, batch)
    out = run_layer(layer, build_metadata(backend, batch), projections(batch), bias)
    batch.assert_output(out.view(batch.query.shape), batch.reference(per_req))


def test_layer_needs_the_forward_context(backend: LoadedBackend) -> None:
    batch = make_batch(SHAPES["decode_single"], DEC, torch.float32, backend.device)
    layer = make_layer(backend, batch)
    with pytest.raises(RuntimeError, match="set_forward_context"):
        layer(*projections(batch))
    with (
        set_forward_context(ForwardContext(attn_metadata={"other.layer": None})),
        pytest.raises(KeyError),
    ):
        layer(*projections(batch))


def test_layer_rejects_bad_configs(backend: LoadedBackend) -> None:
    with use_backend(backend.cls.name):
        with pytest.raises(ValueError, match="prefix"):
            Attention(4, 16, 0.25, 2)
        with pytest.raises(ValueError, match="multiple"):
            Attention(6, 16, 0.25, 4, prefix=PREFIX)
    with use_backend("no_such_backend"), pytest.raises(ValueError, match="unknown"):
        Attention(4, 16, 0.25, 2, prefix=PREFIX)
