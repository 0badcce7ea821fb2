"""UniProcExecutor: one worker in the EngineCore's own process (no tensor parallelism)."""

from __future__ import annotations

from v1.config import EngineConfig
from v1.core.executor import Executor
from v1.core.sched_output import DeferredRunnerOutput, ModelRunnerOutput, SchedulerOutput
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec


class UniProcExecutor(Executor):
    """One worker in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from v1.worker.worker import Worker  # torch and the model: only once a core is built

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
