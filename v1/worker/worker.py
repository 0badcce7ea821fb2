"""Worker: owns the device, joins the tensor-parallel group, loads the model (its rank's shard)
through its ModelRunner and sizes the KV cache."""

from __future__ import annotations

import os

import torch

from v1.config import EngineConfig
from v1.core.sched_output import DeferredRunnerOutput, ModelRunnerOutput, SchedulerOutput
from v1.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec
from v1.logger import init_logger
from v1.worker.gpu_memory import MemoryBaseline
from v1.worker.model_runner import ModelRunner
from v1.worker.step_profiler import StepProfiler

logger = init_logger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int | None = None,
        distributed_init_method: str | None = None,
    ) -> None:
        """rank/local_rank: this worker's tensor-parallel rank and its GPU on this host
        (default: the rank); distributed_init_method: the group's rendezvous URL (needed when
        tensor_parallel_size > 1)."""
        self.config = config
        self.rank = rank
        tp_size = config.parallel_config.tensor_parallel_size
        self.device = torch.device(config.device_config.resolved)
        if self.device.type == "cuda":
            if tp_size > 1:
                self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            elif self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            # Before NCCL and the model: what is in use now is not this engine's to count.
            self.memory_baseline = MemoryBaseline.take(self.device)
        torch.manual_seed(config.model_config.seed)
        self._prev_num_threads: int | None = None
        self.limit_cpu_threads()
        self.tp: TensorParallelGroup | None = None
        if tp_size > 1:
            if distributed_init_method is None:
                raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method")
            self.tp = init_tensor_parallel(rank, tp_size, distributed_init_method, self.device)
        self.model_runner = ModelRunner(config, self.device)
        self.model_runner.tp = self.tp
        self._available_kv_bytes: int | None = None
        self.profiler = StepProfiler.from_env(rank)

    def limit_cpu_threads(self) -> None:
        """On CPU under tensor or data parallelism, the calling thread's ops use the rank's
        share of the host's cores (OpenMP's setting is per thread: called again from the thread
        that will run the steps). With more, OpenMP threads spinning after each op starve the
        rank a collective waits for (steps 50x slower on a busy host), or the other
        data-parallel cores (4-10x slower than one core)."""
        pc = self.config.parallel_config
        num_ranks = pc.tensor_parallel_size * pc.data_parallel_size
        if self.device.type != "cpu" or num_ranks == 1:
            return
        if self._prev_num_threads is None:
            self._prev_num_threads = torch.get_num_threads()
        share = max(1, _num_cpus() // num_ranks)
        torch.set_num_threads(min(self._prev_num_threads, share))

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
        if self._available_kv_bytes is None:  # profiled once
            self._available_kv_bytes = self.model_runner.profile_available_kv_bytes(
                cache_config.gpu_memory_utilization, self.memory_baseline
            )
        return self._available_kv_bytes

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.profiler is None:
            return self.model_runner.execute_model(scheduler_output)
        self.profiler.before_step()
        out = self.model_runner.execute_model(scheduler_output)
        self.profiler.after_step()
        return out

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        if self.profiler is None:
            return self.model_runner.execute_model_async(scheduler_output)
        self.profiler.before_step()
        out = self.model_runner.execute_model_async(scheduler_output)
        self.profiler.after_step()
        return out

    def shutdown(self) -> None:
        self.model_runner.shutdown()
        if self.tp is not None:
            destroy_tensor_parallel()
            self.tp = None
        if self._prev_num_threads is not None:  # rank 0 shares the EngineCore's process
            torch.set_num_threads(self._prev_num_threads)
            self._prev_num_threads = None


def _num_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
