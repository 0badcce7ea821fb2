"""Engine configuration: frozen dataclasses for model, cache, scheduler, parallel and device.

Every field has a docstring; validation raises ValueError with a clear message. Model-family
facts (kind, length limits, sliding window) come from the family's `ModelSpec` row
(v1/models/registry.py), never from `model_type` here.

One module per config group (`model`, `cache`, `scheduler`, `parallel` (with the device),
`lora`), `engine` for `EngineConfig` and the rules resolving its auto values, `args` for flat
engine arguments; this package re-exports their public names (`from v1.config import X`).
"""

from __future__ import annotations

from v1.config.args import engine_arg_fields, make_engine_config
from v1.config.cache import ATTENTION_BACKENDS, CROSS_ATTENTION_MODES, KV_CACHE_DTYPES, CacheConfig
from v1.config.engine import (
    AUTO_MAX_NUM_SEQS,
    AUTO_MAX_NUM_SEQS_ABSORBED,
    AUTO_MAX_NUM_SEQS_POOLING,
    AUTO_NUM_SCHEDULER_STEPS,
    AUTO_POOLING_BATCHED_TOKENS,
    POOLING_PACK_TOKENS,
    POOLING_STEPS_IN_FLIGHT,
    TYPICAL_DECODER_TOKENS,
    EngineConfig,
    attention_types,
    kv_bounded_max_num_seqs,
    pooling_pack_limits,
    pooling_row_tokens,
    resolve_cross_attention,
    resolve_max_num_batched_tokens,
    resolve_max_num_seqs,
    resolve_max_steps_in_flight,
    resolve_num_scheduler_steps,
)
from v1.config.lora import LoRAConfig
from v1.config.model import FP8_IGNORE_REGEX, ModelConfig, check_fp8_ignore
from v1.config.parallel import DeviceConfig, ParallelConfig
from v1.config.scheduler import SchedulerConfig
from v1.models.registry import ModelKind

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO_MAX_NUM_SEQS",
    "AUTO_MAX_NUM_SEQS_ABSORBED",
    "AUTO_MAX_NUM_SEQS_POOLING",
    "AUTO_POOLING_BATCHED_TOKENS",
    "CROSS_ATTENTION_MODES",
    "FP8_IGNORE_REGEX",
    "KV_CACHE_DTYPES",
    "AUTO_NUM_SCHEDULER_STEPS",
    "POOLING_PACK_TOKENS",
    "POOLING_STEPS_IN_FLIGHT",
    "TYPICAL_DECODER_TOKENS",
    "CacheConfig",
    "DeviceConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ModelKind",
    "ParallelConfig",
    "SchedulerConfig",
    "attention_types",
    "check_fp8_ignore",
    "engine_arg_fields",
    "kv_bounded_max_num_seqs",
    "make_engine_config",
    "pooling_pack_limits",
    "pooling_row_tokens",
    "resolve_cross_attention",
    "resolve_max_num_batched_tokens",
    "resolve_max_num_seqs",
    "resolve_max_steps_in_flight",
    "resolve_num_scheduler_steps",
]
