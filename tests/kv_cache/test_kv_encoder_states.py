"""Encoder-states cache (absorbed cross-attention): one entry per distinct encoder input, shared
by content hash, allocated once at admission, freed (and kept as evictable cache) on finish;
its page fits the decoder's self-attention pool; sizing, accounting and preemption."""

from __future__ import annotations

import pytest
from kv_factories import (
    SPEC_KWARGS,
    admit,
    admitted,
    assert_pool_consistent,
    decode_step,
    make_request,
    snapshot,
)

from v1.kv_cache import (
    EncoderStatesManager,
    EncoderStatesSpec,
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheSpec,
    get_kv_cache_config,
)
from v1.kv_cache.spec import encoder_states_spec_in_pool

STATES = "model.decoder.encoder_states"
D_MODEL = SPEC_KWARGS["num_kv_heads"] * SPEC_KWARGS["head_size"]  # 16: Whisper/BART-like


def states_layer_specs(
    block_size: int = 4, num_layers: int = 2, dtype: str = "float16", d_model: int = D_MODEL
) -> dict[str, KVCacheSpec]:
    """Decoder self-attention layers plus the one encoder-states pseudo-layer, as the runner
    lays them out in absorbed mode."""
    kwargs = {**SPEC_KWARGS, "dtype": dtype}
    specs: dict[str, KVCacheSpec] = {
        f"decoder.layers.{i}.self_attn": FullAttentionSpec(block_size, **kwargs)
        for i in range(num_layers)
    }
    specs[STATES] = encoder_states_spec_in_pool(specs["decoder.layers.0.self_attn"], d_model)
    return specs


def make_states_manager(
    num_blocks: int = 32, block_size: int = 4, enable_caching: bool = True
) -> KVCacheManager:
    config = get_kv_cache_config(states_layer_specs(block_size), num_blocks=num_blocks)
    return KVCacheManager(config, max_model_len=1024, enable_caching=enable_caching)


# ---- spec and sizing ----


def test_capacity_counts_the_encoder_states_blocks() -> None:
    """The start-up fit check and admission count what the states manager allocates: a
    request with 20 encoder positions takes ceil(20 / 8) states blocks beside its decoder's."""
    from v1.kv_cache.capacity import max_tokens_that_fit, num_blocks_needed

    config = get_kv_cache_config(states_layer_specs(block_size=4), num_blocks=32)
    decoder_only = num_blocks_needed(config, 10)
    assert num_blocks_needed(config, 10, 20) == decoder_only + 3
    manager = KVCacheManager(config, max_model_len=1024, enable_caching=False)
    free = manager.block_pool.get_num_free_blocks()
    admit(manager, make_request(prompt_len=10, num_encoder_tokens=20))
    assert free - manager.block_pool.get_num_free_blocks() == num_blocks_needed(config, 10, 20)
    assert max_tokens_that_fit(config, 20) < max_tokens_that_fit(config, 0)


def test_states_block_holds_twice_the_tokens_in_the_self_attention_page() -> None:
    specs = states_layer_specs(block_size=4)
    self_spec, states = specs["decoder.layers.0.self_attn"], specs[STATES]
    assert isinstance(states, EncoderStatesSpec)
    # A self page is K and V of 4 tokens x 16 values; E rows have 16 values: 8 of them.
    assert states.block_size == 8 and states.head_size == D_MODEL and states.num_kv_heads == 1
    assert states.real_page_size_bytes == states.page_size_bytes == self_spec.page_size_bytes


def test_a_states_block_spreads_over_the_pool_tensors() -> None:
    """span = the self-attention layers: a block id's page in each of their tensors holds
    states, span x 8 positions a block (8 per page here)."""
    self_spec = FullAttentionSpec(4, **SPEC_KWARGS)
    states = encoder_states_spec_in_pool(self_spec, D_MODEL, span=3)
    assert states.span == 3 and states.block_size == 3 * 8
    assert states.real_page_size_bytes == states.page_size_bytes == self_spec.page_size_bytes
    with pytest.raises(ValueError, match="span must be at least 1"):
        encoder_states_spec_in_pool(self_spec, D_MODEL, span=0)


def test_wider_model_dim_pads_the_states_page() -> None:
    # T5-like: d_model (24) wider than heads x head size (16): 2 rows per half, 8 bytes unused.
    self_spec = FullAttentionSpec(4, **SPEC_KWARGS)
    states = encoder_states_spec_in_pool(self_spec, 24)
    assert states.block_size == 2 * (4 * 16 // 24)
    assert states.real_page_size_bytes == 4 * 24 * 2 < states.page_size_bytes
    assert states.page_size_bytes == self_spec.page_size_bytes
    with pytest.raises(ValueError, match="cannot hold one encoder position"):
        encoder_states_spec_in_pool(FullAttentionSpec(1, 1, 8, "float16"), 24)


def test_fp8_pages_carry_scales_and_states_fit_them() -> None:
    self_spec = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="float8_e4m3fn")
    # K and V: 4 tokens x 2 heads x (8 one-byte values + one float32 scale).
    assert self_spec.page_size_bytes == 2 * 4 * 2 * (8 + 4)
    states = encoder_states_spec_in_pool(self_spec, 16)
    assert states.block_size == 8 and states.has_scales
    assert states.real_page_size_bytes == 8 * (16 + 4) <= states.page_size_bytes


def test_layout_groups_self_then_states_and_shares_tensor_zero() -> None:
    specs = states_layer_specs(block_size=4, num_layers=3)
    page = specs[STATES].page_size_bytes
    config = get_kv_cache_config(specs, available_bytes=3 * page * 10 + 7)
    assert config.num_blocks == 10
    full, states = config.groups
    assert isinstance(full.spec, FullAttentionSpec) and len(full.layer_names) == 3
    assert states.layer_names == (STATES,)
    assert [t.shared_by for t in config.tensors] == [
        ("decoder.layers.0.self_attn", STATES),
        ("decoder.layers.1.self_attn",),
        ("decoder.layers.2.self_attn",),
    ]
    manager = KVCacheManager(config, max_model_len=64)
    assert [type(m) for m in manager.managers] == [FullAttentionManager, EncoderStatesManager]


# ---- allocation, sharing, freeing ----


def test_allocated_once_at_admission_and_never_grown() -> None:
    manager = make_states_manager(block_size=4)
    request = make_request(prompt_len=3, num_encoder_tokens=20)
    self_ids, state_ids = admit(manager, request).get_block_ids()
    assert len(self_ids) == 1 and len(state_ids) == 3  # ceil(20 / 8)
    for _ in range(6):
        assert decode_step(manager, request).get_block_ids()[1] == []
    assert manager.get_block_ids("r0")[1] == state_ids
    manager.free(request)
    manager.free(request)
    assert manager.num_free_blocks == 31 and manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_same_encoder_hash_shares_one_entry(enable_caching: bool) -> None:
    manager = make_states_manager(block_size=4, enable_caching=enable_caching)
    a = admitted(manager, make_request("a", 3, num_encoder_tokens=20, encoder_hash="clip"))
    free_after_a = manager.num_free_blocks
    b = admitted(manager, make_request("b", 5, num_encoder_tokens=20, encoder_hash="clip"))
    other = admitted(manager, make_request("c", 3, num_encoder_tokens=20, encoder_hash="x"))
    a_ids, b_ids, c_ids = (manager.get_block_ids(r.request_id)[1] for r in (a, b, other))
    assert a_ids == b_ids and not set(a_ids) & set(c_ids)
    # b took only its self-attention blocks (5 tokens: 2), c a whole entry too.
    assert manager.num_free_blocks == free_after_a - 2 - (1 + 3)
    pool = manager.block_pool
    assert all(pool.blocks[i].ref_cnt == 2 for i in a_ids)
    manager.free(a)  # b still reads the entry
    assert all(pool.blocks[i].ref_cnt == 1 for i in a_ids)
    late = admitted(manager, make_request("d", 3, num_encoder_tokens=20, encoder_hash="clip"))
    assert manager.get_block_ids(late.request_id)[1] == a_ids
    # The cross-cache hit counters (the server's v1_cross_cache_hit_rate): b and d hit.
    assert (manager.cross_cache_lookups, manager.cross_cache_hits) == (4, 2)
    for request in (b, other, late):
        manager.free(request)
    assert manager.num_free_blocks == 31 and manager.num_requests == 0
    assert_pool_consistent(pool)


def test_freed_entry_is_found_again_only_with_prefix_caching() -> None:
    for enable_caching in (True, False):
        manager = make_states_manager(block_size=4, enable_caching=enable_caching)
        first = admitted(manager, make_request("a", 3, num_encoder_tokens=16, encoder_hash="h"))
        ids = manager.get_block_ids("a")[1]
        manager.free(first)
        again = admitted(manager, make_request("b", 3, num_encoder_tokens=16, encoder_hash="h"))
        assert (manager.get_block_ids("b")[1] == ids) == enable_caching
        manager.free(again)
        assert manager.num_free_blocks == 31
        assert_pool_consistent(manager.block_pool)


def test_evicted_entry_is_allocated_afresh() -> None:
    manager = make_states_manager(num_blocks=8, block_size=4)  # 7 usable blocks
    states = manager.managers[1]
    manager.free(admitted(manager, make_request("a", 3, num_encoder_tokens=16, encoder_hash="h")))
    assert len(states.find_entry("h", 16)) == 2  # freed, still cached
    # Another input takes every block: the cached entry is evicted.
    filler = admitted(manager, make_request("f", 24, num_encoder_tokens=8, encoder_hash="f"))
    assert manager.num_free_blocks == 0
    manager.free(filler)
    assert states.find_entry("h", 16) == []
    again = admitted(manager, make_request("b", 3, num_encoder_tokens=16, encoder_hash="h"))
    new_ids = manager.get_block_ids("b")[1]
    assert len(new_ids) == 2 and states.find_entry("h", 16) == [
        manager.block_pool.blocks[i] for i in new_ids
    ]
    manager.free(again)
    assert_pool_consistent(manager.block_pool)


def test_preemption_frees_and_readmission_reattaches() -> None:
    manager = make_states_manager(block_size=4)
    a = admitted(manager, make_request("a", 6, num_encoder_tokens=12, encoder_hash="h"))
    b = admitted(manager, make_request("b", 6, num_encoder_tokens=12, encoder_hash="h"))
    ids = manager.get_block_ids("a")[1]
    manager.free(b)  # preempted: recompute from scratch later
    b.num_computed_tokens = 0
    assert manager.get_block_ids("b") == ([], [])
    readmitted = admit(manager, b)
    assert readmitted.get_block_ids()[1] == ids  # a still holds the entry: b reattaches
    for request in (a, b):
        manager.free(request)
    assert manager.num_free_blocks == 31 and manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)


def test_allocation_is_all_or_nothing() -> None:
    manager = make_states_manager(num_blocks=5, block_size=4)  # 4 usable blocks
    request = make_request(prompt_len=8, num_encoder_tokens=24)  # 2 self + 3 states blocks
    before = snapshot(manager, ["r0"])
    assert admit(manager, request) is None
    assert snapshot(manager, ["r0"]) == before
    assert manager.get_block_ids("r0") == ([], [])
    # The same input fits once its entry is shared.
    small = make_states_manager(num_blocks=7, block_size=4)  # 6 usable
    admitted(small, make_request("a", 4, num_encoder_tokens=24, encoder_hash="h"))  # 1 + 3
    other_prompt = list(range(100, 108))  # no self-attention prefix hit
    shared = make_request(
        "b", prompt_token_ids=other_prompt, num_encoder_tokens=24, encoder_hash="h"
    )
    assert admit(small, shared) is not None and small.num_free_blocks == 0


def test_request_without_encoder_input_holds_no_states() -> None:
    manager = make_states_manager()
    request = admitted(manager, make_request(prompt_len=5))
    assert manager.get_block_ids(request.request_id)[1] == []
    manager.free(request)
    assert manager.num_free_blocks == 31


def test_lookup_of_a_new_input_makes_one_block_key(monkeypatch) -> None:
    """Admission looks every encoder input up twice; a new one (no cached first block) costs
    one block key and one pool lookup, not one per block (Whisper: 94); a found entry is read
    whole."""
    import struct

    import v1.kv_cache.block_hash as block_hash

    manager = make_states_manager(block_size=4)
    states = manager.managers[1]
    manager.free(admitted(manager, make_request("a", 3, num_encoder_tokens=40, encoder_hash="h")))
    packed: list[int] = []

    class CountingIndex:
        def pack(self, i: int) -> bytes:
            packed.append(i)
            return struct.pack("<I", i)

    monkeypatch.setattr(block_hash, "_BLOCK_INDEX", CountingIndex())
    assert states.find_entry("new", 40) == []
    assert packed == [0]
    packed.clear()
    assert len(states.find_entry("h", 40)) == 5  # freed and cached: all 5 blocks
    assert packed == [0, 1, 2, 3, 4]
