"""Host-to-device copies that never wait for the device.

A non-blocking copy from pageable memory may wait for the stream; from pinned memory (torch's
caching host allocator, which keeps a buffer until its copy has run) it is truly asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """`data` (a CPU tensor or numpy array) on `device`, copied without a host-device sync."""
    tensor = (
        data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
    )
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def parts_to_device(
    parts: list[np.ndarray], device: torch.device, sizes: list[int] | None = None
) -> list[torch.Tensor]:
    """`parts` (numpy arrays of one dtype) on `device` with one copy, as views of one tensor
    of `sizes` (default: one per part; a view may span consecutive parts, e.g. padding). On
    CUDA they are concatenated straight into pinned memory, so no pageable array is staged
    first (`to_device` of a concatenation copied a step's ~60K indices twice on the host)."""
    sizes = [len(p) for p in parts] if sizes is None else sizes
    dtype = torch.from_numpy(parts[0][:0]).dtype
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    np.concatenate(parts, out=host.numpy())
    return list(to_device(host, device).split(sizes))
