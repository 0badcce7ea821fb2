"""The tensor-parallel process group of a worker and the two collectives the layers use.

torch.distributed carries them: gloo on CPU (so CI tests tensor parallelism), NCCL on CUDA.
On CUDA, the small all-reduces of decode steps go through torch's symmetric-memory one-shot
kernel instead (`OneShotAllReduce`). One process per rank; rank 0 is the worker inside the
EngineCore process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from v1 import envs
from v1.logger import init_logger

logger = init_logger(__name__)

ONE_SHOT_MAX_BYTES = 1 << 20
"""Largest all-reduce sent through `OneShotAllReduce` (a decode step's hidden states up to
~128 rows of 4096 bf16); larger ones (prefill, big batches) are bandwidth-bound: NCCL."""


class OneShotAllReduce:
    """An all-reduce in one kernel launch: every rank copies its input into its slice of a
    symmetric-memory buffer (`torch.distributed._symmetric_memory`), the ranks meet at a
    barrier of signal pads, and each sums all ranks' slices over NVLink into its output
    (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`; a second barrier ends it, so the buffer
    is free for the next call). For the 8-64 KiB all-reduces of a decode step it replaces an
    NCCL collective (two per layer) with one short kernel, and it is CUDA-graph capturable.
    bf16 and fp32 only (the op's types); anything else goes through NCCL. NVLink multicast
    stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST): the one-shot kernel reads peers directly."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group_name)

    def serves(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in (torch.bfloat16, torch.float32)
            and 0 < nbytes <= self.max_bytes
            and nbytes % 16 == 0
            and x.is_contiguous()
            and x.data_ptr() % 16 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        slot = self.buffer.view(x.dtype)[: x.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            slot, x.view(-1), "sum", self.group_name, out.view(-1)
        )
        return out


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    group: Any = None
    """The torch.distributed process group (None: the default, whole world)."""
    one_shot: OneShotAllReduce | None = None
    """Small all-reduces on CUDA (None: every all-reduce through `group`'s backend)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (every rank gets the same values): `x` itself, reduced in
        place, or a new tensor (use the result)."""
        if self.one_shot is not None and self.one_shot.serves(x):
            return self.one_shot(x)
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
    one_shot = None
    if device.type == "cuda" and envs.V1_TP_ONE_SHOT:
        one_shot = _one_shot_or_none(rank, world_size, device)
    return TensorParallelGroup(rank=rank, world_size=world_size, one_shot=one_shot)


def _one_shot_or_none(rank: int, world_size: int, device: torch.device) -> OneShotAllReduce | None:
    """A checked `OneShotAllReduce` on the default group, or None (logged) where this torch or
    this machine cannot run it (no peer access, no symmetric memory). Every rank decides
    together: the check ends in an NCCL vote, so no rank takes a path the others do not."""
    one_shot, error = None, ""
    try:
        one_shot = OneShotAllReduce(
            dist.distributed_c10d._get_default_group().group_name, device, ONE_SHOT_MAX_BYTES
        )
        x = torch.arange(4096, device=device, dtype=torch.float32) * (rank + 1)
        expected = torch.arange(4096, device=device, dtype=torch.float32) * (
            world_size * (world_size + 1) / 2
        )
        if not torch.equal(one_shot(x), expected):
            error = "its result differs from the sum"
    except Exception as e:  # noqa: BLE001 - any failure: NCCL carries every all-reduce
        error = f"{type(e).__name__}: {e}"
    vote = torch.tensor([0 if error else 1], device=device, dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    if int(vote.item()) == 1:
        logger.info(
            "tensor parallelism: one-shot all-reduce for up to %d bytes", ONE_SHOT_MAX_BYTES
        )
        return one_shot
    logger.warning(
        "tensor parallelism: every all-reduce goes through NCCL (one-shot all-reduce "
        "unavailable on rank %d: %s)",
        rank,
        error or "another rank failed its check",
    )
    return None


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
