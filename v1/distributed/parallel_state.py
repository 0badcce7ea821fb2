"""The tensor-parallel process group of a worker and the two collectives the layers use.

torch.distributed carries them: gloo on CPU (so CI tests tensor parallelism), NCCL on CUDA.
One process per rank; rank 0 is the worker inside the EngineCore process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    group: Any = None
    """The torch.distributed process group (None: the default, whole world)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (every rank gets the same values)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device
) -> TensorParallelGroup:
    """Joins the process group (gloo on CPU, NCCL on CUDA) and returns this rank's handle.
    `init_method`: a torch.distributed rendezvous URL (file:// in the engine's private
    directory for one host, tcp://HOST:PORT naming an explicit address across hosts)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size
    )
    # A first collective: every rank is connected before the model loads.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(
            f"tensor-parallel group probe summed to {probe.item()}, not {world_size}"
        )
    return TensorParallelGroup(rank=rank, world_size=world_size)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
