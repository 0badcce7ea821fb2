"""From per-layer KV specs and a byte budget to a KVCacheConfig (groups, block count, tensors).

Layers with equal specs form a group; all groups share one pool of equal-sized blocks, and the
j-th layer of every group shares device tensor j (block ids never collide across groups).
"""

from __future__ import annotations

from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)

_MIN_NUM_BLOCKS = 2
"""The null block plus at least one usable block."""


def _group_rank(spec: KVCacheSpec) -> int:
    if isinstance(spec, FullAttentionSpec):
        return 0
    if isinstance(spec, CrossAttentionSpec):
        return 1
    if isinstance(spec, EncoderStatesSpec):
        return 2
    raise ValueError(f"unsupported KV cache spec {type(spec).__name__}")


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Paged groups of layers with equal specs: full attention first, then cross attention,
    then encoder states, each by first layer name. Layers keep their `layer_specs` order inside
    a group; encoder-only layers are dropped (they have no blocks)."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if isinstance(spec, EncoderOnlyAttentionSpec):
            continue
        by_spec.setdefault(spec, []).append(name)
    groups = [KVCacheGroupSpec(tuple(names), spec) for spec, names in by_spec.items()]
    groups.sort(key=lambda group: (_group_rank(group.spec), group.layer_names[0]))
    return tuple(groups)


def get_kv_cache_config(
    layer_specs: dict[str, KVCacheSpec],
    *,
    available_bytes: int | None = None,
    num_blocks: int | None = None,
) -> KVCacheConfig:
    """Lay out the KV cache for `layer_specs` in `available_bytes`, or with exactly `num_blocks`
    blocks (the null block included); give exactly one of the two."""
    if (available_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of available_bytes and num_blocks")
    groups = group_layers(layer_specs)
    if not groups:
        # Encoder-only models: no paged layers, no pool.
        return KVCacheConfig(num_blocks=0, groups=(), tensors=())

    page_sizes = {group.spec.page_size_bytes for group in groups}
    if len(page_sizes) > 1:
        detail = ", ".join(f"{g.layer_names[0]}...: {g.spec.page_size_bytes}" for g in groups)
        raise ValueError(
            f"all paged KV cache groups must have the same block size in bytes, got {detail}"
        )
    page_size = page_sizes.pop()
    max_layers = max(len(group.layer_names) for group in groups)
    bytes_per_block = max_layers * page_size

    if num_blocks is None:
        assert available_bytes is not None
        num_blocks = available_bytes // bytes_per_block
        if num_blocks < _MIN_NUM_BLOCKS:
            raise ValueError(
                f"not enough memory for the KV cache: one block needs {bytes_per_block} bytes "
                f"({max_layers} layers x {page_size} bytes) and at least {_MIN_NUM_BLOCKS} blocks "
                f"({_MIN_NUM_BLOCKS * bytes_per_block} bytes) are needed, but only "
                f"{available_bytes} bytes are available"
            )
    elif num_blocks < _MIN_NUM_BLOCKS:
        raise ValueError(
            f"num_blocks must be at least {_MIN_NUM_BLOCKS} (null block + 1), got {num_blocks}"
        )

    tensors = tuple(
        KVCacheTensor(
            size_bytes=num_blocks * page_size,
            shared_by=tuple(g.layer_names[j] for g in groups if j < len(g.layer_names)),
        )
        for j in range(max_layers)
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=tensors)
