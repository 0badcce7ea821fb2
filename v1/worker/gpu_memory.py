"""The KV cache's share of a GPU. `gpu_memory_utilization` is this engine's own budget, as in
vLLM: its weights, its activations' peak, what it allocates outside PyTorch after it starts
(NCCL, cuBLAS workspaces) and its KV cache. Memory other processes hold on the device (another
engine, a notebook) does not count against it, so two engines at 0.4 share one GPU; a budget
the device cannot hold now is a ValueError at start-up (vLLM's check), not an OOM later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


CONTEXT_SLACK = GIB
"""How far a budget may pass what is free before it is an error: this process's own CUDA
context, which the baseline counts with the other processes' memory (at
gpu_memory_utilization=1.0 the budget passes what is free by about that much)."""


def kv_cache_bytes(
    *,
    utilization: float,
    total: int,
    free: int,
    reserved: int,
    peak: int,
    baseline: MemoryBaseline,
) -> int:
    """Bytes for the KV cache after a max-size profiling step: `utilization` of the device
    (`total`) minus this engine's `peak` PyTorch allocation and its own non-PyTorch memory
    since `baseline`. It must fit in what the device has free for it (`free` plus the
    allocator's cached blocks, less the activations' peak, which the steps need again): within
    CONTEXT_SLACK it is cut to that, past it a ValueError, as is a budget of nothing."""
    own_non_torch = max(0, total - free - reserved - baseline.non_torch)
    budget = int(total * utilization) - peak - own_non_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: peak {peak / GIB:.2f} GiB of {total / GIB:.2f} "
            f"GiB at gpu_memory_utilization={utilization}; lower max_num_batched_tokens or "
            "raise gpu_memory_utilization"
        )
    obtainable = free + reserved - peak
    if budget > obtainable + CONTEXT_SLACK:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for a {budget / GIB:.2f} GiB KV cache, "
            f"but the device has {max(obtainable, 0) / GIB:.2f} GiB free for it "
            f"({baseline.non_torch / GIB:.2f} GiB of its {total / GIB:.2f} GiB were in use when "
            "the engine started); "
            "lower gpu_memory_utilization or free the device"
        )
    return min(budget, obtainable)
