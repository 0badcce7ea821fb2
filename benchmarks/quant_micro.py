"""The fp8 row quantizer alone (CUDA): `quantize_rows_triton` at one turbo encoder step's shapes
(48,000 rows) over a sweep of its launch shape (rows a program x warps), against the default
(`launch_shape`) and a plain copy of the same bytes (the floor):

- fc2's input: fc1's `Fp8Product` [48,000 x 5120] scaled by its row and column scales, fc1's
  bias added, GELU (tanh form), quantized per row (what an fp8 MLP runs between its GEMMs);
- out_proj's input: the attention output [48,000 x 1280] quantized per row.

Every variant's fp8 bytes and scales must equal the default's.

    python3 benchmarks/quant_micro.py [--rows 48000]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from absorbed_kernel import median_us

from v1.quantization.fp8_rows import FP8_DTYPE, FP8_MAX, MIN_SCALE
from v1.quantization.triton_quant import launch_shape, quantize_rows_triton, row_layout

SHAPES = {
    "fc2 input (GELU, Fp8Product, bias)": (5120, True),
    "out_proj input (plain)": (1280, False),
}
SWEEP = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]


def case(rows: int, cols: int, gelu: bool):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
    if not gelu:
        return (x,), {}
    scales = (torch.rand(rows, device="cuda") + 0.5, torch.rand(cols, device="cuda") + 0.5)
    bias = torch.randn(cols, device="cuda", dtype=torch.float16)
    return (x,), {"gelu": "tanh", "bias": bias, "scales": scales}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=48_000)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (cols, gelu) in SHAPES.items():
        (x,), kw = case(args.rows, cols, gelu)
        moved = x.numel() * 2 + x.numel() + args.rows * 4  # read 16-bit, write fp8 + scales
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        floor = median_us(functools.partial(dst.copy_, src))  # `moved` bytes in all
        ref_q, ref_s = quantize_rows_triton(x, FP8_DTYPE, FP8_MAX, MIN_SCALE, **kw)
        chunk, n = row_layout(cols, gelu)
        default = launch_shape(chunk * n, gelu)
        print(
            f"\n{name}: {args.rows} x {cols}, {moved / 1e6:.0f} MB moved; copy floor "
            f"{floor:.1f} us ({moved / floor / 1e3:.0f} GB/s); default launch {default}"
        )
        print("| rows x warps | us | GB/s | vs floor | equal |")
        print("|---|---:|---:|---:|---|")
        for launch in [default] + [s for s in SWEEP if s != default]:
            fn = functools.partial(
                quantize_rows_triton, x, FP8_DTYPE, FP8_MAX, MIN_SCALE, launch=launch, **kw
            )
            q, s = fn()
            same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(
                s, ref_s
            )
            us = median_us(fn)
            mark = " (default)" if launch == default else ""
            print(
                f"| {launch[0]} x {launch[1]}{mark} | {us:.1f} | {moved / us / 1e3:.0f} | "
                f"{floor / us:.0%} | {same} |"
            )


if __name__ == "__main__":
    main()
