"""KVBlockCopier: the runner's device copies of whole KV blocks (forks' partial blocks) move
every byte of a block's K and V rows (and fp8 scales) in each tensor holding decoder
self-attention, read every source before writing any target, and touch nothing else.
On CPU and, marked `gpu`, on CUDA."""

from __future__ import annotations

import pytest
import torch

from v1.kv_cache import CrossAttentionSpec, FullAttentionSpec, get_kv_cache_config
from v1.worker.kv_cache_views import KVBlockCopier, allocate_kv_cache

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
NUM_BLOCKS = 12


def make_views(dtype: str, device: str):
    specs = {}
    for i in range(2):
        specs[f"decoder.{i}.self_attn"] = FullAttentionSpec(4, 2, 8, dtype)
        specs[f"decoder.{i}.encoder_attn"] = CrossAttentionSpec(4, 2, 8, dtype)
    config = get_kv_cache_config(specs, num_blocks=NUM_BLOCKS)
    views = allocate_kv_cache(config, torch.device(device))
    generator = torch.Generator().manual_seed(0)
    for cache in views.values():
        for region in (cache.values, cache.scales):
            if region is not None:
                raw = region.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))
    return config, views


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_block_copies_read_every_source_before_writing(device: str, dtype: str) -> None:
    config, views = make_views(dtype, device)
    before = {
        name: [r.view(torch.uint8).clone() for r in (c.values, c.scales) if r is not None]
        for name, c in views.items()
    }
    # 3 -> 5 and 5 -> 7: block 7 gets block 5's old rows, not block 3's.
    copies = [(3, 5), (5, 7), (1, 9)]
    KVBlockCopier(config, views)(copies)
    moved = {dst: src for src, dst in copies}
    for name, cache in views.items():
        regions = [r.view(torch.uint8) for r in (cache.values, cache.scales) if r is not None]
        for region, old in zip(regions, before[name], strict=True):
            for block in range(NUM_BLOCKS):
                # Every layer sharing a tensor sees the whole block copied.
                want = old[:, moved.get(block, block)]
                assert torch.equal(region[:, block], want), (name, block)


def test_no_copies_is_a_no_op() -> None:
    config, views = make_views("float32", "cpu")
    snapshot = {n: c.values.view(torch.uint8).clone() for n, c in views.items()}
    KVBlockCopier(config, views)([])
    assert all(torch.equal(views[n].values.view(torch.uint8), v) for n, v in snapshot.items())
