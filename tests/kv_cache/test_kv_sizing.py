"""get_kv_cache_config: grouping by spec, tensor sharing across groups, block counts, errors."""

from __future__ import annotations

import pytest
from kv_factories import SPEC_KWARGS, make_layer_specs

from v1.kv_cache import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    get_kv_cache_config,
)

PAGE = FullAttentionSpec(4, **SPEC_KWARGS).page_size_bytes  # 2 * 4 * 2 * 8 * 2 = 256


def test_whisper_layout_groups_self_and_cross_and_shares_tensors() -> None:
    specs = make_layer_specs(block_size=4, num_layers=2, cross=True, encoder_only_layers=2)
    config = get_kv_cache_config(specs, available_bytes=10 * 2 * PAGE + 5)
    assert config.num_blocks == 10
    assert config.block_size == 4
    self_group, cross_group = config.groups
    assert isinstance(self_group.spec, FullAttentionSpec)
    assert isinstance(cross_group.spec, CrossAttentionSpec)
    assert self_group.layer_names == ("decoder.layers.0.self_attn", "decoder.layers.1.self_attn")
    assert cross_group.layer_names == (
        "decoder.layers.0.encoder_attn",
        "decoder.layers.1.encoder_attn",
    )
    assert [t.shared_by for t in config.tensors] == [
        ("decoder.layers.0.self_attn", "decoder.layers.0.encoder_attn"),
        ("decoder.layers.1.self_attn", "decoder.layers.1.encoder_attn"),
    ]
    assert all(t.size_bytes == 10 * PAGE for t in config.tensors)
    # Encoder layers have no cache at all.
    assert not any("encoder.layers" in name for t in config.tensors for name in t.shared_by)


def test_uneven_groups_use_max_layers_tensors() -> None:
    specs: dict[str, KVCacheSpec] = {
        f"dec.{i}.self": FullAttentionSpec(4, **SPEC_KWARGS) for i in range(3)
    }
    specs["dec.0.cross"] = CrossAttentionSpec(4, **SPEC_KWARGS)
    config = get_kv_cache_config(specs, available_bytes=3 * PAGE * 7)
    assert config.num_blocks == 7
    assert [t.shared_by for t in config.tensors] == [
        ("dec.0.self", "dec.0.cross"),
        ("dec.1.self",),
        ("dec.2.self",),
    ]


def test_group_order_is_full_then_cross_then_by_first_layer_name() -> None:
    other_full = FullAttentionSpec(4, num_kv_heads=1, head_size=16, dtype="float16")
    assert other_full.page_size_bytes == PAGE
    specs: dict[str, KVCacheSpec] = {
        "c.cross": CrossAttentionSpec(4, **SPEC_KWARGS),
        "b.self": other_full,
        "a.self": FullAttentionSpec(4, **SPEC_KWARGS),
    }
    config = get_kv_cache_config(specs, num_blocks=4)
    assert [g.layer_names for g in config.groups] == [("a.self",), ("b.self",), ("c.cross",)]
    reordered = get_kv_cache_config(dict(reversed(list(specs.items()))), num_blocks=4)
    assert reordered.groups == config.groups


def test_exact_num_blocks() -> None:
    config = get_kv_cache_config(make_layer_specs(num_layers=3), num_blocks=5)
    assert config.num_blocks == 5 and len(config.groups) == 1
    assert [t.size_bytes for t in config.tensors] == [5 * PAGE] * 3


def test_different_page_sizes_are_rejected() -> None:
    specs: dict[str, KVCacheSpec] = {
        "a": FullAttentionSpec(4, **SPEC_KWARGS),
        "b": CrossAttentionSpec(8, **SPEC_KWARGS),
    }
    with pytest.raises(ValueError, match="same block size in bytes"):
        get_kv_cache_config(specs, num_blocks=4)


def test_too_little_memory_says_what_one_block_needs() -> None:
    specs = make_layer_specs(num_layers=2)
    with pytest.raises(ValueError, match=f"one block needs {2 * PAGE} bytes"):
        get_kv_cache_config(specs, available_bytes=2 * 2 * PAGE - 1)
    assert get_kv_cache_config(specs, available_bytes=2 * 2 * PAGE).num_blocks == 2


@pytest.mark.parametrize(
    "kwargs", [{}, {"available_bytes": 1 << 20, "num_blocks": 4}, {"num_blocks": 1}]
)
def test_bad_arguments_are_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        get_kv_cache_config(make_layer_specs(), **kwargs)


def test_unsupported_spec_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported KV cache spec"):
        get_kv_cache_config({"x": KVCacheSpec(4, **SPEC_KWARGS)}, num_blocks=4)
