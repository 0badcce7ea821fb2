"""Where the model runs: how it is spread over devices (`ParallelConfig`) and which device
(`DeviceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from v1 import envs


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices."""

    tensor_parallel_size: int = 1
    """Devices one model is sharded over: one worker process per rank (rank 0 inside the
    EngineCore process), linked by torch.distributed (gloo on CPU, NCCL on CUDA)."""
    distributed_executor_backend: str | None = None
    """How the ranks' workers are placed: "mp" (processes on this machine; the default when
    tensor_parallel_size > 1) or "ray" (Ray actors in a placement group, across nodes; needs the
    `ray` extra). None with tensor_parallel_size=1: the worker runs inside the EngineCore."""
    data_parallel_size: int = 1
    """EngineCore processes serving the model side by side, each on its own device set
    (tensor_parallel_size devices); the frontend sends each request to the least-loaded one."""

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
            )

    @property
    def executor_backend(self) -> str:
        """uni (one worker in the core: always with tensor_parallel_size=1), mp or ray."""
        if self.tensor_parallel_size == 1:
            return "uni"
        return self.distributed_executor_backend or "mp"


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""

    def __post_init__(self) -> None:
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @cached_property
    def resolved(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_type(self) -> str:
        return self.resolved.split(":")[0]

    @staticmethod
    def visible_cuda_devices() -> list[str]:
        """The ids of the CUDA devices this process may use (CUDA_VISIBLE_DEVICES or all)."""
        listed = envs.cuda_visible_devices()
        if listed is not None:
            return listed
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
