"""Llama-3-8B's per-layer elementwise ops, torch path against the fused Triton kernel (CUDA):
residual add + RMSNorm [T, 4096], SiLU-and-mul [T, 2 x 14336] -> [T, 14336] and RoPE of
q [T, 32 x 128] and k [T, 8 x 128], at T = 1, 8 and 256 rows, bf16. Each op runs 100 times
inside one CUDA graph (as a decode step replays it); a replay is timed with CUDA events and
the median of 5 divided by 100 is printed, so launch overhead is what a graph pays. The
eager column is the same op called 100 times without a graph (host launch cost included: the
layers take the kernel eagerly at every size, `use_fused_elementwise`).

    python3 benchmarks/llama_layers.py [--dtype fp16] [--rows 1 8 256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from v1.models.layers.norm import RMSNorm
from v1.models.layers.rotary import RotaryEmbedding
from v1.models.layers.triton_activation import silu_and_mul_triton
from v1.models.layers.triton_rms_norm import add_rms_norm_triton
from v1.models.layers.triton_rotary import rope_triton

HIDDEN, INTER, HEADS, KV_HEADS, HEAD = 4096, 14336, 32, 8, 128
CALLS, REPEATS = 100, 5


def graph_us(fn: Callable[[], object]) -> float:
    """Median over REPEATS replays of a graph of CALLS calls of fn, per call, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def eager_us(fn: Callable[[], object]) -> float:
    """Median over REPEATS runs of CALLS eager calls of fn (host time until the GPU is
    done), per call, in us."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / CALLS)
    return sorted(times)[len(times) // 2]


def ops(rows: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """name -> (torch path, fused kernel) on the same inputs."""
    norm = RMSNorm(HIDDEN, 1e-5).to("cuda", dtype)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
    r = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
    gu = torch.randn(rows, 2 * INTER, device="cuda", dtype=dtype)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD))
    rope = RotaryEmbedding(HEAD, inv_freq).cuda()
    widths = [HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD]
    q, k, _ = torch.randn(rows, sum(widths), device="cuda", dtype=dtype).split(widths, dim=-1)
    positions = torch.randint(0, 8192, (rows,), device="cuda")

    def torch_add_norm():
        h = x + r
        return norm._norm(h), h

    def torch_silu():
        gate, up = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def torch_rope():
        cos, sin = rope.cos_sin(positions, dtype)
        return rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)

    return {
        "add + RMSNorm": (torch_add_norm, lambda: add_rms_norm_triton(x, r, norm.weight, 1e-5)),
        "RMSNorm": (lambda: norm._norm(x), lambda: add_rms_norm_triton(x, None, norm.weight, 1e-5)),
        "SiluAndMul": (torch_silu, lambda: silu_and_mul_triton(gu)),
        "RoPE q+k": (
            torch_rope,
            lambda: rope_triton(positions, q, k, HEAD, rope.inv_freq, rope.attention_scaling),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256])
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, us per call in a CUDA graph")
    for rows in args.rows:
        per_layer = [0.0, 0.0]
        for name, (reference, fused) in ops(rows, dtype).items():
            t_ref, t_fused = graph_us(reference), graph_us(fused)
            e_ref, e_fused = eager_us(reference), eager_us(fused)
            if name != "RMSNorm":  # a layer: 2 x add + RMSNorm, SiluAndMul, RoPE
                weight = 2 if name == "add + RMSNorm" else 1
                per_layer[0] += weight * t_ref
                per_layer[1] += weight * t_fused
            print(
                f"T={rows:4d} {name:14s} torch {t_ref:7.2f} us  fused {t_fused:7.2f} us"
                f"  ({t_ref / t_fused:.1f}x); eager torch {e_ref:7.2f} us  fused {e_fused:7.2f} us",
                flush=True,
            )
        print(
            f"T={rows:4d} per layer (2 add+norm, silu, rope): torch {per_layer[0]:.1f} us, "
            f"fused {per_layer[1]:.1f} us; x32 layers: {32 * (per_layer[0] - per_layer[1]):.0f}"
            " us saved per step",
            flush=True,
        )


if __name__ == "__main__":
    main()
