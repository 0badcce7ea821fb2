"""Encoder-decoder and encoder-only configs: cross-attention blocks allocated once per
admission, shared and cached by encoder content hash, never leaked; encoder-only groups hold
nothing."""

from __future__ import annotations

import pytest
from kv_factories import (
    SPEC_KWARGS,
    admit,
    admitted,
    assert_pool_consistent,
    decode_step,
    make_layer_specs,
    make_manager,
    make_request,
    snapshot,
)

from v1.kv_cache import (
    CrossAttentionManager,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionManager,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    get_kv_cache_config,
)


def test_whisper_config_has_self_then_cross_group() -> None:
    manager = make_manager(cross=True)
    assert [type(m) for m in manager.managers] == [FullAttentionManager, CrossAttentionManager]


def test_cross_blocks_are_allocated_once_and_never_grow() -> None:
    manager = make_manager(num_blocks=16, block_size=4, cross=True)
    request = make_request(prompt_len=3, num_encoder_tokens=10)
    self_ids, cross_ids = admit(manager, request).get_block_ids()
    assert len(self_ids) == 1 and len(cross_ids) == 3  # ceil(10 / 4)
    for _ in range(6):
        assert decode_step(manager, request).get_block_ids()[1] == []
    # A later call that passes the encoder length again adds nothing either.
    request.append_output_token_ids([5])
    again = manager.allocate_slots(request, 1, num_encoder_tokens=10)
    assert again.get_block_ids()[1] == []
    assert manager.get_block_ids(request.request_id)[1] == cross_ids
    assert len(manager.get_block_ids(request.request_id)[0]) == 3  # 10 tokens
    assert manager.num_free_blocks == 15 - 6


def test_request_without_encoder_input_gets_no_cross_blocks() -> None:
    manager = make_manager(cross=True)
    request = make_request(prompt_len=5)
    assert admit(manager, request).get_block_ids() == (manager.get_block_ids("r0")[0], [])
    assert len(manager.get_block_ids("r0")[0]) == 2


@pytest.mark.parametrize("chunk", [None, 2], ids=["full-prefill", "mid-prefill"])
def test_preempt_then_readmit_then_finish_leaks_nothing(chunk: int | None) -> None:
    manager = make_manager(num_blocks=16, block_size=4, cross=True)
    request = make_request(prompt_len=6, num_encoder_tokens=9)
    admit(manager, request, num_new_tokens=chunk)
    assert manager.num_free_blocks == 15 - (1 if chunk else 2) - 3
    # Preemption: free everything, recompute from scratch later.
    manager.free(request)
    manager.free(request)
    request.num_computed_tokens = 0
    assert manager.num_free_blocks == 15 and manager.num_requests == 0
    readmitted = admit(manager, request)
    assert len(readmitted.blocks[1]) == 3
    assert manager.num_free_blocks == 15 - 2 - 3
    decode_step(manager, request)
    manager.free(request)  # finish (or abort)
    assert manager.num_free_blocks == 15 and manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)


def test_freed_cross_blocks_are_cached_by_encoder_content() -> None:
    manager = make_manager(num_blocks=16, block_size=4, cross=True)
    a = make_request("a", prompt_len=9, num_encoder_tokens=8, encoder_hash="x")
    a_self, a_cross = admit(manager, a).get_block_ids()
    manager.free(a)
    pool = manager.block_pool
    assert {group_id for group_id, _ in pool.cached_block_hash_to_block} == {0, 1}
    assert all(pool.blocks[i].block_hash is not None for i in a_cross)

    b = make_request("b", prompt_len=9, num_encoder_tokens=8, encoder_hash="x")
    assert manager.has_encoder_entry(b)
    computed, num_computed = manager.get_computed_blocks(b)
    assert num_computed == 8 and computed.get_block_ids() == (a_self[:2], [])
    b_self, b_cross = manager.allocate_slots(b, 1, num_computed, computed, 8).get_block_ids()
    assert b_self[:2] == a_self[:2] and b_cross == a_cross  # attached, nothing projected again
    other = make_request("c", prompt_len=9, num_encoder_tokens=8, encoder_hash="y")
    assert not manager.has_encoder_entry(other)
    manager.free(b)
    assert manager.num_free_blocks == 15
    assert_pool_consistent(pool)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_same_encoder_hash_shares_one_cross_entry(enable_caching: bool) -> None:
    manager = make_manager(num_blocks=32, block_size=4, cross=True, enable_caching=enable_caching)
    a = admitted(manager, make_request("a", 3, num_encoder_tokens=12, encoder_hash="clip"))
    b = admitted(manager, make_request("b", 5, num_encoder_tokens=12, encoder_hash="clip"))
    a_ids, b_ids = (manager.get_block_ids(r.request_id)[1] for r in (a, b))
    assert a_ids == b_ids and len(a_ids) == 3
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in a_ids)
    manager.free(a)  # b still reads the entry: a preempted or aborted a keeps it alive
    late = make_request("d", 3, num_encoder_tokens=12, encoder_hash="clip")
    assert manager.has_encoder_entry(late)
    manager.free(b)
    # Freed by its last reader: found again only through the prefix cache.
    assert manager.has_encoder_entry(late) == enable_caching
    assert manager.num_free_blocks == 31 and manager.num_requests == 0
    assert_pool_consistent(manager.block_pool)


def test_same_decoder_prompt_over_other_audio_does_not_hit() -> None:
    manager = make_manager(block_size=4, cross=True)
    manager.free(admitted(manager, make_request("a", 9, num_encoder_tokens=4, encoder_hash="x")))
    other = make_request("b", 9, num_encoder_tokens=4, encoder_hash="y")
    assert manager.get_computed_blocks(other)[1] == 0


def test_cross_allocation_is_all_or_nothing() -> None:
    manager = make_manager(num_blocks=6, block_size=4, cross=True)  # 5 usable blocks
    request = make_request(prompt_len=8, num_encoder_tokens=16)  # 2 self + 4 cross blocks
    before = snapshot(manager, ["r0"])
    assert admit(manager, request) is None
    assert snapshot(manager, ["r0"]) == before
    assert request.num_computed_tokens == 0


def test_cross_manager_counts_blocks_only_before_first_allocation() -> None:
    manager = make_manager(block_size=4, cross=True)
    cross = manager.managers[1]
    assert cross.get_num_blocks_to_allocate("r", 100, 9, []) == 3
    cross.allocate_new_blocks("r", 100, 9)
    assert cross.get_num_blocks_to_allocate("r", 200, 50, []) == 0
    assert cross.allocate_new_blocks("r", 200, 50) == []
    cross.free("r")
    cross.free("r")
    assert cross.get_blocks("r") == [] and manager.num_free_blocks == 15


def test_encoder_only_model_allocates_nothing() -> None:
    specs = make_layer_specs(num_layers=0, encoder_only_layers=3)
    config = get_kv_cache_config(specs, available_bytes=1 << 20)
    assert config.groups == () and config.tensors == ()
    manager = KVCacheManager(config, max_model_len=512)
    request = make_request(prompt_len=12, pooling=True)
    assert manager.get_computed_blocks(request)[1] == 0
    blocks = manager.allocate_slots(request, 12)
    assert blocks is not None and blocks.get_block_ids() == ()
    assert blocks is manager.NO_NEW_BLOCKS  # shared: no object built per admission
    assert manager.num_total_blocks == 0 and manager.usage == 0.0
    manager.free(request)
    assert manager.num_requests == 0


def test_explicit_encoder_only_group_gets_an_empty_table() -> None:
    spec = EncoderOnlyAttentionSpec(4, **SPEC_KWARGS)
    cross = CrossAttentionSpec(4, **SPEC_KWARGS)
    config = KVCacheConfig(
        num_blocks=8,
        groups=(KVCacheGroupSpec(("enc",), spec), KVCacheGroupSpec(("dec.cross",), cross)),
        tensors=(),
    )
    manager = KVCacheManager(config, max_model_len=64)
    request = make_request(prompt_len=5, num_encoder_tokens=5)
    assert admit(manager, request).get_block_ids()[0] == []
    assert len(manager.get_block_ids("r0")[1]) == 2
    assert manager.get_computed_blocks(request)[1] == 0  # no full-attention group
