"""The KV cache's share of a GPU. `gpu_memory_utilization` is this engine's own budget, as in
vLLM: its weights, its activations' peak, what it allocates outside PyTorch after it starts
(NCCL, cuBLAS workspaces) and its KV cache. Memory other processes hold on the device (another
engine, a notebook) does not count against it, so two engines at 0.4 share one GPU; but the
KV cache never takes more than the device has free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.logger import init_logger

logger = init_logger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryBaseline:
    """Device memory in use outside this process's PyTorch allocator when its worker started:
    other processes' and this process's CUDA context."""

    non_torch: int

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total - free - torch.cuda.memory_reserved(device))


def kv_cache_bytes(
    *,
    utilization: float,
    total: int,
    free: int,
    reserved: int,
    allocated: int,
    peak: int,
    baseline: MemoryBaseline,
) -> int:
    """Bytes for the KV cache after a max-size profiling step: `utilization` of the device
    (`total`) minus this engine's `peak` PyTorch allocation and its own non-PyTorch memory
    since `baseline`, capped by what allocations can still get (`free` plus the allocator's
    cached blocks, `reserved - allocated`). ValueError when nothing is left."""
    own_non_torch = max(0, total - free - reserved - baseline.non_torch)
    budget = int(total * utilization) - peak - own_non_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: peak {peak / GIB:.2f} GiB of {total / GIB:.2f} "
            f"GiB at gpu_memory_utilization={utilization}; lower max_num_batched_tokens or "
            "raise gpu_memory_utilization"
        )
    obtainable = free + reserved - allocated
    if obtainable <= 0:
        raise ValueError(
            f"no memory left for the KV cache: the device has {free / GIB:.2f} GiB free, other "
            f"processes hold {baseline.non_torch / GIB:.2f} GiB of its {total / GIB:.2f} GiB; "
            "lower gpu_memory_utilization or free the device"
        )
    if obtainable < budget:
        logger.warning(
            "KV cache: %.2f GiB (what the device has free) instead of the %.2f GiB "
            "gpu_memory_utilization=%s allows; other processes hold %.2f GiB of it",
            obtainable / GIB,
            budget / GIB,
            utilization,
            baseline.non_torch / GIB,
        )
    return min(budget, obtainable)
