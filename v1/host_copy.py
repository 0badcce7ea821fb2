"""Host-to-device copies that never wait for the device.

A non-blocking copy from pageable host memory may make the driver wait for the stream (it
stages the data first), which would stall a pipelined step behind the one still running; from
pinned memory it is truly asynchronous. The pinned buffer comes from torch's caching host
allocator, which keeps it from reuse until the copy has run.
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
