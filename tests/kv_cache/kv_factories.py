"""Factories and invariant checks shared by the KV cache tests."""

from __future__ import annotations

from v1.core.protocol import EncoderInput
from v1.core.request import Request
from v1.kv_cache import (
    BlockPool,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    KVCacheSpec,
    get_kv_cache_config,
)
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

SPEC_KWARGS = {"num_kv_heads": 2, "head_size": 8, "dtype": "float16"}


def make_layer_specs(
    block_size: int = 4,
    num_layers: int = 2,
    cross: bool = False,
    encoder_only_layers: int = 0,
) -> dict[str, KVCacheSpec]:
    """Decoder self-attention layers, optional cross-attention layers (one per decoder layer,
    Whisper/BART-style) and optional encoder layers without cache."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(encoder_only_layers):
        specs[f"encoder.layers.{i}.self_attn"] = EncoderOnlyAttentionSpec(block_size, **SPEC_KWARGS)
    for i in range(num_layers):
        specs[f"decoder.layers.{i}.self_attn"] = FullAttentionSpec(block_size, **SPEC_KWARGS)
        if cross:
            specs[f"decoder.layers.{i}.encoder_attn"] = CrossAttentionSpec(
                block_size, **SPEC_KWARGS
            )
    return specs


def make_kv_cache_config(
    num_blocks: int = 16, block_size: int = 4, cross: bool = False, num_layers: int = 2
) -> KVCacheConfig:
    return get_kv_cache_config(
        make_layer_specs(block_size, num_layers, cross), num_blocks=num_blocks
    )


def make_manager(
    num_blocks: int = 16,
    block_size: int = 4,
    cross: bool = False,
    enable_caching: bool = True,
    max_model_len: int = 1024,
) -> KVCacheManager:
    config = make_kv_cache_config(num_blocks=num_blocks, block_size=block_size, cross=cross)
    return KVCacheManager(config, max_model_len=max_model_len, enable_caching=enable_caching)


def make_request(
    req_id: str = "r0",
    prompt_len: int = 10,
    prompt_token_ids: list[int] | None = None,
    max_tokens: int = 16,
    num_encoder_tokens: int = 0,
    encoder_hash: str = "audio-0",
    pooling: bool = False,
) -> Request:
    """A request whose prompt is `prompt_token_ids` or 0..prompt_len-1; with
    `num_encoder_tokens` > 0 it carries an encoder input of that length and hash."""
    if prompt_token_ids is None:
        prompt_token_ids = list(range(prompt_len))
    encoder_input = None
    if num_encoder_tokens > 0:
        encoder_input = EncoderInput(
            num_encoder_tokens=num_encoder_tokens,
            content_hash=encoder_hash,
            token_ids=list(range(num_encoder_tokens)),
        )
    if pooling:
        return Request(req_id, prompt_token_ids, pooling_params=PoolingParams())
    return Request(
        req_id,
        prompt_token_ids,
        SamplingParams(max_tokens=max_tokens),
        encoder_input=encoder_input,
    )


def assert_pool_consistent(pool: BlockPool) -> None:
    """Every non-null block is in the free queue xor referenced; counts add up; the prefix-cache
    map and the blocks' hashes agree; the null block is neither free nor referenced."""
    free_blocks = pool.free_block_queue.get_all_free_blocks()
    free_ids = [block.block_id for block in free_blocks]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert 0 not in free_ids
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    num_used = 0
    for block in pool.blocks[1:]:
        is_free = block.block_id in free_ids
        assert is_free != (block.ref_cnt > 0), block
        if not is_free:
            assert block.prev_free_block is None and block.next_free_block is None
            num_used += 1
    assert pool.get_num_free_blocks() + num_used == pool.num_blocks - 1
    cached = {
        block.block_id
        for blocks in pool.cached_block_hash_to_block.values()
        for block in blocks.values()
    }
    for (group_id, block_hash), blocks in pool.cached_block_hash_to_block.items():
        assert blocks, "empty entries must be dropped"
        for block in blocks.values():
            assert block.block_hash == block_hash and block.group_id == group_id
    assert cached == {b.block_id for b in pool.blocks if b.block_hash is not None}


def admit(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> KVCacheBlocks | None:
    """What the scheduler does for a waiting request: prefix lookup, then allocation for
    `num_new_tokens` (default: the rest of its tokens), then marking them computed."""
    computed, num_computed = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_computed
    blocks = manager.allocate_slots(
        request,
        num_new_tokens,
        num_computed,
        computed,
        num_encoder_tokens=request.num_encoder_tokens,
    )
    if blocks is not None:
        request.num_computed_tokens = num_computed + num_new_tokens
    return blocks


def decode_step(manager: KVCacheManager, request: Request, token: int = 7) -> KVCacheBlocks | None:
    """Append one sampled token and allocate its slot, as a decode step does."""
    request.append_output_token_ids([token])
    blocks = manager.allocate_slots(request, 1)
    if blocks is not None:
        request.num_computed_tokens += 1
    return blocks


def snapshot(manager: KVCacheManager, req_ids: list[str]) -> tuple:
    """Everything allocate_slots may change, to check that a failed call changed nothing."""
    pool = manager.block_pool
    return (
        pool.get_num_free_blocks(),
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        [(block.ref_cnt, block.block_hash) for block in pool.blocks],
        {key: sorted(blocks) for key, blocks in pool.cached_block_hash_to_block.items()},
        [manager.get_block_ids(req_id) for req_id in req_ids],
        manager.num_requests,
    )


def admitted(manager: KVCacheManager, request: Request) -> Request:
    """Admit a request that must fit; returns it for chaining."""
    assert admit(manager, request) is not None
    return request
