"""Executor: the EngineCore's handle on its worker(s), as an interface only.

Torch-free, so the core and its tests never import device code. The implementations live above
the core (v1/executor); whoever builds a core chooses one and hands it down.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeAlias

from v1.config import EngineConfig
from v1.core.sched_output import (
    DeferredRunnerOutput,
    ModelRunnerOutput,
    ReadyRunnerOutput,
    SchedulerOutput,
)
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec


class Executor(ABC):
    @abstractmethod
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, for every attention layer of the model."""

    @abstractmethod
    def determine_available_kv_bytes(self) -> int:
        """Bytes the KV cache may take (profiled on GPU, configured on CPU)."""

    @abstractmethod
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        """Launches a step and returns before it finishes (pipelined scheduling); executors
        that cannot defer run it now."""
        return ReadyRunnerOutput(self.execute_model(scheduler_output))

    def set_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs (on another thread) when the executor breaks while the core
        is not stepping, e.g. a worker process exits; executors without workers never call
        it."""
        return None

    def shutdown(self) -> None:
        return None


ExecutorFactory: TypeAlias = Callable[[EngineConfig], Executor]
"""What a core is built with: an Executor class, or any callable making one from the config."""
