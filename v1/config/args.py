"""Flat engine arguments (`LLM(model, block_size=...)`, CLI flags) and the configs that own them."""

from __future__ import annotations

import dataclasses
from typing import Any

from v1.config.cache import CacheConfig
from v1.config.engine import EngineConfig
from v1.config.lora import LoRAConfig
from v1.config.model import ModelConfig
from v1.config.parallel import DeviceConfig, ParallelConfig
from v1.config.scheduler import SchedulerConfig

_ENGINE_ARG_OWNERS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    LoRAConfig,
)


def engine_arg_fields() -> list[tuple[type, dataclasses.Field]]:
    """Every user-settable engine argument with the dataclass that owns it (CLI --help uses it)."""
    out = []
    for owner in _ENGINE_ARG_OWNERS:
        for f in dataclasses.fields(owner):
            if f.name not in ("hf_config", "model", "hf_overrides"):
                out.append((owner, f))
    return out


def make_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`LLM(model, block_size=..., ...)`)."""
    parts: dict[type, dict[str, Any]] = {owner: {} for owner in _ENGINE_ARG_OWNERS}
    enforce_eager = bool(kwargs.pop("enforce_eager", False))
    offline = bool(kwargs.pop("offline", False))
    hf_config = kwargs.pop("hf_config", None)
    names = {f.name: owner for owner in _ENGINE_ARG_OWNERS for f in dataclasses.fields(owner)}
    for key, value in kwargs.items():
        if key not in names or key in ("model", "hf_config"):
            raise ValueError(f"unknown engine argument {key!r}")
        parts[names[key]][key] = value
    model_config = ModelConfig(model=model, hf_config=hf_config, **parts[ModelConfig])
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(**parts[CacheConfig]),
        scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
        parallel_config=ParallelConfig(**parts[ParallelConfig]),
        device_config=DeviceConfig(**parts[DeviceConfig]),
        enforce_eager=enforce_eager,
        lora_config=LoRAConfig(**parts[LoRAConfig]),
        offline=offline,
    )
