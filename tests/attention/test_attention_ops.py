"""The plain-torch oracles (naive_attention, write_kv_cache, gather_kv) and the T5 relative
position buckets, checked against torch SDPA and transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from v1.attention.ops.reference import gather_kv, naive_attention, write_kv_cache
from v1.attention.ops.t5_bias import relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (32, 20)])
def test_relative_position_bucket_matches_transformers_t5(
    bidirectional: bool, num_buckets: int, max_distance: int
) -> None:
    # Imported here: transformers is slow to import and only this test needs it.
    from transformers.models.t5.modeling_t5 import T5Attention

    gen = torch.Generator().manual_seed(0)
    rel = torch.randint(-500, 501, (4, 300), generator=gen)
    rel[0, :41] = torch.arange(-20, 21)  # every small distance, 0 included
    ours = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, theirs)
    assert ours.min() >= 0 and ours.max() == num_buckets - 1


def _qkv(num_q: int, num_k: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    gen = torch.Generator().manual_seed(num_q * 100 + num_k)
    q = torch.randn(num_q, heads, dim, generator=gen)
    k = torch.randn(num_k, kv_heads, dim, generator=gen)
    v = torch.randn(num_k, kv_heads, dim, generator=gen)
    return q, k, v


@pytest.mark.parametrize(("num_q", "num_k"), [(1, 1), (9, 9), (1, 13), (5, 21)])
@pytest.mark.parametrize("causal", [True, False])
def test_naive_attention_matches_sdpa(num_q: int, num_k: int, causal: bool) -> None:
    q, k, v = _qkv(num_q, num_k)
    bias = torch.randn(4, num_q, num_k)
    # Causal aligns the last query with the last key: query j sees keys 0 .. num_k - num_q + j.
    allowed = torch.ones(num_q, num_k, dtype=torch.bool)
    if causal:
        allowed = torch.arange(num_k)[None, :] <= torch.arange(num_q)[:, None] + num_k - num_q
    mask = bias.masked_fill(~allowed, float("-inf"))
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=0.3, enable_gqa=True
    ).transpose(0, 1)
    out = naive_attention(q, k, v, scale=0.3, causal=causal, bias=bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_naive_attention_causal_ignores_future_keys() -> None:
    q, k, v = _qkv(3, 10)
    out = naive_attention(q, k, v, 0.5, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[8:], v2[8:] = 100.0, 100.0  # query 0 sits at position 7
    out2 = naive_attention(q, k2, v2, 0.5, causal=True)
    assert torch.equal(out[0], out2[0])
    assert not torch.allclose(out[1:], out2[1:])


def test_write_kv_cache_skips_minus_one_and_touches_nothing_else() -> None:
    cache = torch.randn(2, 5, 4, 2, 3)
    before = cache.clone()
    key, value = torch.randn(6, 2, 3), torch.randn(6, 2, 3)
    slots = torch.tensor([17, -1, 4, 5, -1])  # key row 5 lies past the slot mapping: ignored
    write_kv_cache(key, value, cache, slots)
    flat, flat_before = cache.view(2, 20, 2, 3), before.view(2, 20, 2, 3)
    for row, slot in ((0, 17), (2, 4), (3, 5)):
        assert torch.equal(flat[0, slot], key[row]) and torch.equal(flat[1, slot], value[row])
    untouched = [s for s in range(20) if s not in (17, 4, 5)]
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_gather_kv_follows_block_order() -> None:
    cache = torch.arange(2 * 4 * 3).float().view(2, 4, 3, 1, 1)
    k, v = gather_kv(cache, [3, 1], 5)
    assert k.flatten().tolist() == [9, 10, 11, 3, 4]
    assert v.flatten().tolist() == [21, 22, 23, 15, 16]
