"""What a new batch size costs the first time: cuDNN's dense attention builds an execution plan
per shape, and cuBLAS may load a new GEMM kernel for a new row count (Whisper's encoder shape,
fp16). Why the encoder's attention runs in power-of-two parts, warmed at start (session 23).

    python3 benchmarks/cudnn_plans.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention(batch: int) -> torch.Tensor:
    q = torch.randn(batch, 1500, 20, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, q, q, scale=0.125)


def first_and_second(fn: Callable[[], object]) -> tuple[float, float]:
    """Milliseconds of the first and of the second call (synchronized)."""
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main() -> None:
    attention(32)
    for batch in [25, 31, 24, 7, 1, 25, 16, 2]:
        first, second = first_and_second(lambda b=batch: attention(b))
        print(f"attention batch {batch}: first {first:.1f} ms, second {second:.2f} ms")
    weight = torch.randn(5120, 1280, device="cuda", dtype=torch.float16)
    for rows in [37500, 46500, 12000]:
        x = torch.randn(rows, 1280, device="cuda", dtype=torch.float16)
        first, second = first_and_second(lambda x=x: x @ weight.t())
        print(f"GEMM {rows} x 1280 -> 5120: first {first:.2f} ms, second {second:.2f} ms")


if __name__ == "__main__":
    main()
