"""`cross_attention="auto"`: per-layer K/V or absorbed cross-attention, decided once at start-up.

The rule (docs/architecture.md, "Cross-attention modes", keeps it and the measurements behind it):
on CPU, per_layer (compute-bound: absorbed attends over d_model-wide rows, H x d / D times the
FLOPs); on a GPU, absorbed when the cache cannot hold `min(max_num_seqs, PER_LAYER_ENOUGH_BATCH)`
requests of the longest decoder sequence and encoder input with per-layer K/V, else per_layer.
Measured on an H100 (large-v3, 512 clips): per_layer at the 286 requests its K/V fit gave 1,690
RTFx, absorbed at 512 requests 1,306: today's absorbed kernel costs ~1.3x per request-step what
per-layer K/V does, so it only pays where per-layer K/V leaves the batch too small to fill a step.
"""

from __future__ import annotations

from v1.config import EngineConfig
from v1.kv_cache.sizing import get_kv_cache_config
from v1.kv_cache.spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec

PER_LAYER_ENOUGH_BATCH = 64
"""A per-layer batch this large keeps the decoder step bandwidth-bound (its fixed costs
amortized), so `auto` keeps per_layer even when `max_num_seqs` requests would not fit."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def per_layer_blocks_per_request(
    specs: dict[str, KVCacheSpec], max_model_len: int, max_encoder_len: int
) -> int:
    """Blocks one request of the longest decoder sequence and encoder input takes in every
    group of a per-layer layout (a group takes one block table per request)."""
    total = 0
    for spec in {
        s for s in specs.values() if isinstance(s, (FullAttentionSpec, CrossAttentionSpec))
    }:
        length = max_model_len if isinstance(spec, FullAttentionSpec) else max_encoder_len
        total += cdiv(length, spec.block_size)
    return total


def choose_cross_attention(
    config: EngineConfig,
    per_layer_specs: dict[str, KVCacheSpec],
    device_type: str,
    available_bytes: int | None,
) -> str:
    """per_layer or absorbed for `config.cache_config.cross_attention == "auto"`, from the
    per-layer specs and the cache budget (bytes, or the configured num_kv_blocks)."""
    mode = config.cache_config.cross_attention
    if mode != "auto":
        return mode
    if device_type != "cuda" or not any(
        isinstance(s, CrossAttentionSpec) for s in per_layer_specs.values()
    ):
        return "per_layer"
    num_blocks = config.cache_config.num_kv_blocks
    if num_blocks is None:
        assert available_bytes is not None
        num_blocks = get_kv_cache_config(
            per_layer_specs, available_bytes=available_bytes
        ).num_blocks
    mc = config.model_config
    batch = min(config.scheduler_config.max_num_seqs, PER_LAYER_ENOUGH_BATCH)
    need = batch * per_layer_blocks_per_request(
        per_layer_specs, mc.effective_max_model_len, mc.max_encoder_len
    )
    return "per_layer" if need <= num_blocks - 1 else "absorbed"
