"""The Whisper large-v3 encoder's GEMMs and attention alone (CUDA): torch._scaled_mm on fp8
operands with row-wise scales and a bias (what an fp8 Linear ran before session 11), row-wise
without the bias, tensor-wise (what `Fp8Product` layers run) and the fp16 matmul, at 48,000 rows
(one 32-clip encoder step), the 16-bit Linear with and without its bias and GELU epilogues;
then the SDPA backends on one step's attention shape.

    python3 benchmarks/encoder_micro.py
"""

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from absorbed_kernel import median_us

ROWS = 48_000
SHAPES = [("qkv_proj", 3840, 1280), ("out_proj", 1280, 1280), ("fc1", 5120, 1280)]
SHAPES += [("fc2", 1280, 5120), ("8192^3", 8192, 8192)]


def gemm_variants(m: int, n: int, k: int) -> dict[str, Callable[[], torch.Tensor]]:
    fp8, half = torch.float8_e4m3fn, torch.float16
    a, w = torch.randn(m, k, device="cuda").to(fp8), torch.randn(n, k, device="cuda").to(fp8)
    sa, sw = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    bias, unit = torch.randn(n, device="cuda", dtype=half), torch.tensor(1 / 448, device="cuda")
    ah, wh = a.to(half), w.to(half)
    return {
        "row-wise + bias": lambda: torch._scaled_mm(
            a, w.t(), scale_a=sa, scale_b=sw, bias=bias, out_dtype=half
        ),
        "row-wise": lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=half),
        "tensor-wise": lambda: torch._scaled_mm(
            a, w.t(), scale_a=unit, scale_b=unit, out_dtype=half
        ),
        "fp16": lambda: ah @ wh.t(),
    }


def fp16_variants(m: int, n: int, k: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The 16-bit forms of a Linear: its GEMM alone, with the bias epilogue (F.linear), with
    cuBLASLt's bias + GELU epilogue (`linear_act`), and the GEMM then one GELU pass."""
    half = torch.float16
    x = torch.randn(m, k, device="cuda", dtype=half)
    w = torch.randn(n, k, device="cuda", dtype=half) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=half)
    return {
        "mm": lambda: x @ w.t(),
        "linear + bias": lambda: F.linear(x, w, bias),
        "bias + GELU epilogue": lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True),
        "linear + bias, then GELU": lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"),
    }


def main() -> None:
    for name, n, k in SHAPES[:4]:
        cells = []
        for label, fn in fp16_variants(ROWS, n, k).items():
            us = median_us(fn)
            cells.append(f"{label} {us:.0f} us ({2 * ROWS * n * k / us / 1e6:.0f} TFLOP/s)")
        print(f"fp16 {name} M={ROWS} N={n} K={k}: " + "; ".join(cells), flush=True)
    for name, n, k in SHAPES:
        m = 8192 if name == "8192^3" else ROWS
        cells = []
        for label, fn in gemm_variants(m, n, k).items():
            us = median_us(fn)
            cells.append(f"{label} {us:.0f} us ({2 * m * n * k / us / 1e6:.0f} TFLOP/s)")
        print(f"GEMM {name} M={m} N={n} K={k}: " + "; ".join(cells), flush=True)

    b, h, length, d = 32, 20, 1500, 64
    qkv = torch.randn(b * length, 3, h, d, device="cuda", dtype=torch.float16)
    strided = [qkv[:, i].unflatten(0, (b, length)).transpose(1, 2) for i in range(3)]
    layouts = {"strided (as the engine)": strided, "contiguous": [x.contiguous() for x in strided]}
    flops = 4 * b * h * length * length * d
    for label, backend in (
        ("cuDNN", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        for layout, (q, k, v) in layouts.items():

            def attend(q=q, k=k, v=v) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v)

            with sdpa_kernel(backend):
                us = median_us(attend)
            print(f"attention {label}, {layout}: {us:.0f} us ({flops / us / 1e6:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
