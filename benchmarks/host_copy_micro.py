"""What a host-to-device copy of a step's small arrays costs on the host (`v1.host_copy`):
`to_device` (pin_memory from torch's caching host allocator, then a non-blocking copy) against
a copy staged in a preallocated pinned buffer, for int64 arrays of several sizes, with the
device idle and with it busy (a queue of GEMMs ahead of the copies). Median host us a call.

    python3 benchmarks/host_copy_micro.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from v1.host_copy import to_device  # noqa: E402


def staged(buffer: torch.Tensor, data: np.ndarray, device: torch.device) -> torch.Tensor:
    host = buffer[: data.size]
    np.copyto(host.numpy(), data)
    return host.to(device, non_blocking=True)


def time_calls(fn, data: np.ndarray, busy: bool, calls: int = 200) -> float:
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    samples = []
    for i in range(calls):
        if busy and i % 20 == 0:
            for _ in range(10):
                a @ a  # ~1.4 ms of queued work
        start = time.perf_counter()
        fn(data)
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> int:
    device = torch.device("cuda")
    buffer = torch.empty(1 << 22, dtype=torch.int64, pin_memory=True)
    print("| int64 elements | device | to_device us | staged pinned buffer us |")
    print("|---:|---|---:|---:|")
    for n in (64, 4096, 48_000, 240_000, 1_000_000):
        data = np.arange(n, dtype=np.int64)
        for busy in (False, True):
            ours = time_calls(lambda d: to_device(d, device), data, busy)
            stage = time_calls(lambda d: staged(buffer, d, device), data, busy)
            print(f"| {n:,} | {'busy' if busy else 'idle'} | {ours:.1f} | {stage:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
