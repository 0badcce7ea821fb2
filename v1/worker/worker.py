"""Worker: owns the device, loads the model through its ModelRunner and sizes the KV cache."""

from __future__ import annotations

import torch

from v1.config import EngineConfig
from v1.core.sched_output import DeferredRunnerOutput, ModelRunnerOutput, SchedulerOutput
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec
from v1.logger import init_logger
from v1.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device_config.resolved)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs()

    def determine_available_kv_bytes(self) -> int:
        cache_config = self.config.cache_config
        if self.device.type != "cuda":
            return cache_config.cpu_kv_cache_bytes
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        return self.model_runner.profile_available_kv_bytes(cache_config.gpu_memory_utilization)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        return self.model_runner.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        self.model_runner.shutdown()
