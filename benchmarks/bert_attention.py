"""BERT-base attention over bert_embed.py's workload (4096 inputs of 16-512 tokens, 12 heads of
64, fp16), cut into steps of 32,768 tokens / 512 inputs as the engine packs them, inputs in
random or length-sorted order: flash varlen on the packed rows against cuDNN's dense attention
on each step padded to its longest input (with and without the key-padding mask; without it
the result is wrong, an upper bound). Device time of the 12 layers' calls, median of 5.

    python3 benchmarks/bert_attention.py
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_SIZE, STEP_TOKENS, STEP_INPUTS, LAYERS = 12, 64, 32768, 512, 12


def steps(lengths: np.ndarray) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for length in lengths.tolist():
        if sum(out[-1]) + length > STEP_TOKENS or len(out[-1]) == STEP_INPUTS:
            out.append([])
        out[-1].append(length)
    return out


def flash(step: list[int]) -> Callable[[], object]:
    q = torch.randn(sum(step), HEADS, HEAD_SIZE, device="cuda", dtype=torch.float16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(step)]), device="cuda", dtype=torch.int32)
    longest = max(step)
    return lambda: torch.ops.aten._flash_attention_forward(
        q, q, q, cu, cu, longest, longest, 0.0, False, False, scale=0.125
    )


def dense(step: list[int], mask: bool) -> Callable[[], object]:
    longest = (max(step) + 7) // 8 * 8
    q = torch.randn(len(step), HEADS, longest, HEAD_SIZE, device="cuda", dtype=torch.float16)
    lens = torch.tensor(step, device="cuda")
    keys = torch.arange(longest, device="cuda")[None, :] < lens[:, None]
    attn_mask = keys[:, None, None, :] if mask else None

    def run() -> object:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask, scale=0.125)

    return run


def device_ms(fns: list[Callable[[], object]], repeats: int = 5) -> float:
    for fn in fns:
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fns:
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return LAYERS * float(np.median(times))


def main() -> None:
    lengths = np.random.default_rng(0).integers(16, 513, size=4096)
    orders = {
        "random": np.random.default_rng(1).permutation(len(lengths)),
        "sorted": np.argsort(-lengths, kind="stable"),
    }
    for name, order in orders.items():
        cut = steps(lengths[order])
        print(f"{name}: {len(cut)} steps; flash varlen {device_ms([flash(s) for s in cut]):.1f} ms")
        for mask in (False, True):
            ms = device_ms([dense(s, mask) for s in cut])
            print(f"   cuDNN dense, padded, mask={mask}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
