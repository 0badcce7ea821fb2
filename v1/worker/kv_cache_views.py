"""Device tensors of the KV cache pool and the views every paged layer reads.
Must hold: all specs that share a buffer agree on where block i lives (layout at `PoolLayout`),
so attention layers and the encoder states of absorbed cross-attention view the same bytes.
`KVBlockCopier` copies whole blocks inside the pool (forks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from v1.host_copy import to_device
from v1.kv_cache.spec import (
    SCALE_BYTES,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
)

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass(frozen=True)
class PoolLayout:
    """Bytes of one block's chunk in each half: values, and scales (0 unless fp8).

    One uint8 buffer per KVCacheTensor, shared by the j-th layer of every group: two halves
    (K and V) of `num_blocks` chunks of values, then, for fp8 caches, two halves of
    `num_blocks` chunks of float32 scales:
        [values: half 0 | half 1][scales: half 0 | half 1], each half [num_blocks, chunk].
    An attention layer sees values [2, num_blocks, block_size, Hkv, D] (+ scales [2,
    num_blocks, block_size, Hkv]); the encoder states of absorbed cross-attention see the
    first `rows_per_half * d` values of each chunk, in each of the first `span` buffers, as
    [span, 2, num_blocks, rows_per_half, d] (+ scales [span, 2, num_blocks, rows_per_half]):
    the buffers are slices of one allocation, so that view is a strided tensor."""

    value_chunk: int
    scale_chunk: int

    @classmethod
    def of(cls, spec: KVCacheSpec) -> PoolLayout:
        """The layout an attention spec (not encoder states) defines."""
        rows = spec.block_size * spec.num_kv_heads
        value_bytes = torch_dtype(spec.dtype).itemsize
        return cls(
            rows * spec.head_size * value_bytes, rows * SCALE_BYTES if spec.has_scales else 0
        )


@dataclass
class LayerCache:
    values: torch.Tensor
    scales: torch.Tensor | None


def _halves(buffer: torch.Tensor, start: int, num_blocks: int, chunk: int) -> torch.Tensor:
    """Bytes [start, start + 2 * num_blocks * chunk) as [2, num_blocks, chunk]."""
    return buffer[start : start + 2 * num_blocks * chunk].view(2, num_blocks, chunk)


def attention_views(
    buffer: torch.Tensor, spec: KVCacheSpec, num_blocks: int, layout: PoolLayout
) -> LayerCache:
    """values [2, num_blocks, block_size, Hkv, D] and (fp8) scales [2, num_blocks, block_size,
    Hkv] of one attention layer."""
    dtype = torch_dtype(spec.dtype)
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    values = _halves(buffer, 0, num_blocks, layout.value_chunk).view(dtype).view(shape)
    scales = None
    if spec.has_scales:
        start = 2 * num_blocks * layout.value_chunk
        raw = _halves(buffer, start, num_blocks, layout.scale_chunk)
        scales = raw.view(torch.float32).view(shape[:-1])
    return LayerCache(values, scales)


def encoder_states_views(
    buffer: torch.Tensor, spec: EncoderStatesSpec, num_blocks: int, layout: PoolLayout | None
) -> LayerCache:
    """values [span, 2, num_blocks, rows_per_half, d] and (fp8) scales [span, 2, num_blocks,
    rows_per_half] inside the chunks of `layout` (the attention layers' that share the
    buffers; None: the encoder states alone, chunks exactly their size). `buffer`: the first
    `spec.span` pool buffers back to back (one allocation), uint8."""
    dtype = torch_dtype(spec.dtype)
    span = spec.span
    rows, dim = spec.block_size // (2 * span), spec.head_size
    if layout is None:
        layout = PoolLayout(rows * dim * dtype.itemsize, rows * SCALE_BYTES * spec.has_scales)
    buffers = buffer.view(span, -1)  # [span, bytes of one pool buffer]

    def region(start: int, chunk: int, used: int) -> torch.Tensor:
        # [span, 2, num_blocks, used] of each buffer's two halves of num_blocks chunks
        raw = buffers[:, start : start + 2 * num_blocks * chunk].view(span, 2, num_blocks, chunk)
        return raw[..., :used]

    value_bytes = rows * dim * dtype.itemsize
    assert value_bytes <= layout.value_chunk
    values = region(0, layout.value_chunk, value_bytes).view(dtype)
    values = values.view(span, 2, num_blocks, rows, dim)
    scales = None
    if spec.has_scales:
        assert rows * SCALE_BYTES <= layout.scale_chunk
        start = 2 * num_blocks * layout.value_chunk
        scales = region(start, layout.scale_chunk, rows * SCALE_BYTES).view(torch.float32)
    return LayerCache(values, scales)


def allocate_kv_cache(config: KVCacheConfig, device: torch.device) -> dict[str, LayerCache]:
    """Zeroed buffers for `config` and the views of every layer (and of the encoder states,
    under their pseudo-layer name), by layer name."""
    spec_of = {name: group.spec for group in config.groups for name in group.layer_names}
    views: dict[str, LayerCache] = {}
    # One allocation, one slice per tensor: encoder states spread a block over several.
    sizes = [tensor.size_bytes for tensor in config.tensors]
    pool = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    starts = np.cumsum([0, *sizes]).tolist()
    for j, tensor in enumerate(config.tensors):
        buffer = pool[starts[j] : starts[j + 1]]
        attention_specs = [
            spec_of[name]
            for name in tensor.shared_by
            if not isinstance(spec_of[name], EncoderStatesSpec)
        ]
        layout = PoolLayout.of(attention_specs[0]) if attention_specs else None
        for name in tensor.shared_by:
            spec = spec_of[name]
            if isinstance(spec, EncoderStatesSpec):
                span = spec.span
                assert j == 0 and span <= len(sizes) and len(set(sizes[:span])) == 1, (
                    f"{name}: a states block spreads over the first {span} of {len(sizes)} "
                    "equal pool tensors"
                )
                views[name] = encoder_states_views(
                    pool[: starts[span]], spec, config.num_blocks, layout
                )
            else:
                assert layout is not None and PoolLayout.of(spec) == layout, (
                    f"{name}: layers sharing a KV tensor must lay blocks out alike"
                )
                views[name] = attention_views(buffer, spec, config.num_blocks, layout)
    return views


class KVBlockCopier:
    """Copies whole KV blocks (SchedulerOutput.block_copies: the partial last block of a forked
    sequence) in every KV cache tensor that holds decoder self-attention: one batched index
    copy per region (values; scales too for fp8) of each tensor, all on the device."""

    def __init__(self, config: KVCacheConfig, views: dict[str, LayerCache]) -> None:
        spec_of = {name: group.spec for group in config.groups for name in group.layer_names}
        self.regions: list[torch.Tensor] = []
        """[2, num_blocks, chunk bytes] uint8 views, each block's chunk of K and V rows."""
        for tensor in config.tensors:
            # The j-th layers of all groups share the tensor and lay blocks out alike: the
            # chunks of one decoder self-attention layer cover the block in this tensor.
            name = next(
                (n for n in tensor.shared_by if isinstance(spec_of[n], FullAttentionSpec)), None
            )
            if name is None:
                continue
            cache = views[name]
            for region in (cache.values, cache.scales):
                if region is not None:
                    # [2, num_blocks, block_size, Hkv(, D)] -> [2, num_blocks, chunk bytes]
                    self.regions.append(region.view(torch.uint8).view(*region.shape[:2], -1))

    def __call__(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies or not self.regions:
            return
        device = self.regions[0].device
        src, dst = to_device(np.asarray(copies, dtype=np.int64).T.copy(), device)
        for region in self.regions:
            # index_select materializes every src before index_copy_ writes a dst (a block
            # freed by one fork may be the copy target of another in the same step).
            region.index_copy_(1, dst, region.index_select(1, src))
