"""Executor: the EngineCore's handle on its worker(s).

The interface is torch-free so the core and its tests never import device code; the
single-process executor imports the worker lazily, and the tensor-parallel ones
(v1/distributed) are chosen by `executor_class` from the parallel config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from v1.core.client import EngineDeadError
from v1.core.sched_output import (
    DeferredRunnerOutput,
    ModelRunnerOutput,
    ReadyRunnerOutput,
    SchedulerOutput,
)
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec

if TYPE_CHECKING:
    from v1.config import EngineConfig


class WorkerDeadError(EngineDeadError):
    """A worker process (a tensor-parallel rank) is gone: the engine cannot step any more and
    dies loudly, as when its core dies (every pending request fails with EngineDeadError)."""


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


def executor_class(config: EngineConfig) -> Callable[[EngineConfig], Executor]:
    """The executor for `config.parallel_config` (uni, mp or ray)."""
    backend = config.parallel_config.executor_backend
    if backend == "mp":
        from v1.distributed.mp_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from v1.distributed.ray_executor import RayExecutor

        return RayExecutor
    return UniProcExecutor


class UniProcExecutor(Executor):
    """One worker in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from v1.worker.worker import Worker

        self.worker = Worker(config)
        self.worker.load_model()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.worker.get_kv_cache_specs()

    def determine_available_kv_bytes(self) -> int:
        return self.worker.determine_available_kv_bytes()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.worker.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        return self.worker.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
