"""Multi-LoRA kernel time against the base GEMM it rides on, old (per-row BGMV) vs new (tiled
SGMV) in the same run: whisper-large-v3-turbo's projections (d_model 1280, ffn 5120) with
rank-16 adapters (the fused QKV: 3 sub-projections x 16 = rank 48), 16 adapters in the batch.

- encoder: 256 clips x 1500 rows = 384,000 rows per step, each clip's rows one adapter
  (round-robin over the 16), the shape SGMV is for;
- decode: 256 rows, one per request, adapters interleaved (BGMV's shape; SGMV shown too).

Per shape: the base GEMM (F.linear), BGMV (shrink + expand), SGMV (shrink + expand) and the one
`ops.add_lora` picks, in ms (CUDA events, median) and as a fraction of the base GEMM; the max
difference between BGMV and SGMV outputs; and the encoder layer's sum (qkv + out + fc1 + fc2).
`--sweep` also times SGMV block shapes on the encoder QKV shape.

    python3 benchmarks/lora_kernels.py                 # the GPU run (< 1 min on an H200)
    python3 benchmarks/lora_kernels.py --sweep         # + SGMV block-shape sweep
    TRITON_INTERPRET=1 python3 benchmarks/lora_kernels.py --device cpu --tiny   # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from v1.lora.ops import use_sgmv  # noqa: E402
from v1.lora.triton_ops import bgmv_add_lora, sgmv_add_lora  # noqa: E402

# (name, rows per clip (encoder) or None (decode: one row per request), in, sub-projection
# output sizes)
TURBO = [
    ("encoder qkv", 1500, 1280, (1280, 1280, 1280)),
    ("encoder out_proj", 1500, 1280, (1280,)),
    ("encoder fc1", 1500, 1280, (5120,)),
    ("encoder fc2", 1500, 5120, (1280,)),
    ("decode qkv", None, 1280, (1280, 1280, 1280)),
    ("decode fc2", None, 5120, (1280,)),
]
TINY = [
    ("encoder qkv", 100, 64, (64, 64, 64)),
    ("encoder fc2", 100, 256, (64,)),
    ("decode qkv", None, 64, (64, 64, 64)),
]


def timer(device: str, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median ms of `fn` over `iters` runs after one warm-up (CUDA events on the GPU)."""

    def run(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def make_case(rows_per_clip, k, subs, args, device, dtype):
    num_rows = args.clips * rows_per_clip if rows_per_clip else args.clips
    n, rank = sum(subs), args.rank * len(subs)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(num_rows, k, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k**-0.5
    a = torch.randn(args.adapters, rank, k, device=device, dtype=dtype, generator=gen) * 0.05
    b = torch.zeros(args.adapters, n, rank, device=device, dtype=dtype)
    row = 0
    for j, size in enumerate(subs):  # block diagonal, as LoRALinear lays fused layers out
        cols = slice(j * args.rank, (j + 1) * args.rank)
        b[:, row : row + size, cols] = torch.randn(
            args.adapters, size, args.rank, device=device, dtype=dtype, generator=gen
        )
        row += size
    per_request = torch.arange(args.clips, device=device) % args.adapters
    if rows_per_clip:
        indices = per_request.repeat_interleave(rows_per_clip)
    else:
        perm = torch.randperm(args.clips, device=device, generator=gen)
        indices = per_request[perm]  # decode: adapters interleaved
    rows_per_run = float(rows_per_clip or 1)
    return x, weight, a, b, indices, rows_per_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--clips", type=int, default=256, help="requests (clips) per step")
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16, help="rank per sub-projection")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="SGMV block shapes, encoder qkv")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    args = parser.parse_args()
    if args.tiny:
        args.clips, args.adapters, args.iters = min(args.clips, 3), min(args.adapters, 2), 1
    device, dtype = args.device, getattr(torch, args.dtype)
    measure = timer(device, args.iters)
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()}, {args.dtype}, {args.clips} requests, "
              f"{args.adapters} adapters, rank {args.rank} per sub-projection")  # fmt: skip
    header = f"{'shape':<17} {'rows':>7} {'K':>5} {'N':>5} {'R':>3} | {'base ms':>8} | "
    header += f"{'BGMV ms':>8} {'%base':>6} | {'SGMV ms':>8} {'%base':>6} | picks | max|diff|"
    print(header)
    encoder = {"base": 0.0, "bgmv": 0.0, "sgmv": 0.0}
    for name, rows_per_clip, k, subs in TINY if args.tiny else TURBO:
        x, weight, a, b, indices, rows_per_run = make_case(
            rows_per_clip, k, subs, args, device, dtype
        )
        base = F.linear(x, weight)
        out_b, out_s = base.clone(), base.clone()
        t_base = measure(lambda: F.linear(x, weight))  # noqa: B023
        t_bgmv = measure(lambda: bgmv_add_lora(out_b, x, a, b, indices))  # noqa: B023
        t_sgmv = measure(
            lambda: sgmv_add_lora(out_s, x, a, b, indices, subs, rows_per_run)  # noqa: B023
        )
        # one more call of each from the same base: the two kernels' outputs side by side
        out_b.copy_(base)
        out_s.copy_(base)
        bgmv_add_lora(out_b, x, a, b, indices)
        sgmv_add_lora(out_s, x, a, b, indices, subs, rows_per_run)
        diff = (out_b.float() - out_s.float()).abs().max().item()
        picks = "SGMV" if use_sgmv(rows_per_run) else "BGMV"
        print(
            f"{name:<17} {x.shape[0]:>7} {k:>5} {sum(subs):>5} {a.shape[1]:>3} | "
            f"{t_base:>8.3f} | {t_bgmv:>8.3f} {100 * t_bgmv / t_base:>5.0f}% | "
            f"{t_sgmv:>8.3f} {100 * t_sgmv / t_base:>5.0f}% | {picks:<5} | {diff:.3g}"
        )
        if rows_per_clip:
            encoder["base"] += t_base
            encoder["bgmv"] += t_bgmv
            encoder["sgmv"] += t_sgmv
    print(
        f"encoder layer (the encoder shapes summed): base {encoder['base']:.3f} ms, "
        f"+BGMV {encoder['bgmv']:.3f} ms (+{100 * encoder['bgmv'] / encoder['base']:.0f}%), "
        f"+SGMV {encoder['sgmv']:.3f} ms (+{100 * encoder['sgmv'] / encoder['base']:.0f}%)"
    )
    if args.sweep:
        sweep(args, device, dtype, measure)


def sweep(args, device, dtype, measure) -> None:
    name, rows_per_clip, k, subs = (TINY if args.tiny else TURBO)[0]
    x, weight, a, b, indices, rows_per_run = make_case(rows_per_clip, k, subs, args, device, dtype)
    out = F.linear(x, weight)
    t_base = measure(lambda: F.linear(x, weight))
    print(f"# SGMV block sweep on {name} ({x.shape[0]} rows), base GEMM {t_base:.3f} ms")
    results = []
    for block_m, block_m_expand, block_k, block_n, warps, stages in [
        (64, 64, 64, 128, 4, 3),
        (128, 64, 64, 128, 4, 3),
        (128, 64, 128, 128, 8, 3),
        (128, 128, 64, 128, 8, 3),
        (128, 64, 64, 256, 8, 3),
        (256, 64, 64, 128, 8, 3),
        (128, 32, 64, 128, 4, 4),
        (64, 64, 128, 64, 4, 2),
        (128, 128, 64, 64, 4, 4),
    ]:
        blocks = dict(
            block_m=block_m,
            block_m_expand=block_m_expand,
            block_k=block_k,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        try:
            t = measure(lambda: sgmv_add_lora(out, x, a, b, indices, subs, **blocks))  # noqa: B023
        except Exception as exc:  # a shape the compiler rejects (shared memory)
            print(f"{blocks}: failed ({type(exc).__name__})")
            continue
        results.append((t, blocks))
        print(f"{blocks}: {t:.3f} ms ({100 * t / t_base:.0f}% of base)")
    best = min(results, key=lambda r: r[0])
    print(f"best: {best[1]} {best[0]:.3f} ms")


if __name__ == "__main__":
    main()
