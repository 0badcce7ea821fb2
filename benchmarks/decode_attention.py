"""The paged attention kernel alone at decode shapes (CUDA): one query token a request over its
cached K/V, the engine's decode metadata (16-row work items), replayed from a CUDA graph, over a
sweep of the launch (K/V positions a step x warps x stages) against the committed one, with
the bytes of K/V read and the copy rate's time for them (the floor). Every variant's output
must match the committed launch's.

- whisper: Whisper large-v3 / turbo decoder self-attention, 256 requests, 20 heads of 64, 5-104
  cached tokens (a 100-token transcription's range);
- llama-1b: 64 requests, 32 query / 8 KV heads of 64, 128-384 cached tokens;
- llama-8b: 64 requests, 32 / 8 heads of 128, 256-1024 cached tokens.

    python3 benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from absorbed_kernel import median_us

from v1.attention.backends.triton import DECODE_BLOCK_M
from v1.attention.ops.triton_attention import make_work_items, paged_attention

PAGE = 16
SHAPES = {  # requests, query heads, KV heads, head size, fewest / most cached tokens
    "whisper": (256, 20, 20, 64, 5, 104),
    "llama-1b": (64, 32, 8, 64, 128, 384),
    "llama-8b": (64, 32, 8, 128, 256, 1024),
}
COMMITTED = (64, 4, 2)
SWEEP = [(32, 4, 2), (32, 2, 2), (64, 2, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2)]


def build(name: str, dtype: torch.dtype):
    batch, heads, kv_heads, dim, low, high = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(low, high + 1, (batch,), generator=gen)
    blocks = (lens + PAGE - 1) // PAGE
    num_blocks = int(blocks.sum()) + 1
    cache = torch.randn(2, num_blocks, PAGE, kv_heads, dim, generator=gen).to("cuda", dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(batch, int(blocks.max()), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks.tolist()):
        table[r, :n] = order[start : start + n]
        start += n
    offsets = torch.arange(batch + 1, dtype=torch.int32)
    work = make_work_items(offsets, DECODE_BLOCK_M, torch.device("cuda"))
    q = torch.randn(batch, heads, dim, generator=gen).to("cuda", dtype)
    args = dict(
        query_start_loc=offsets.cuda(),
        seq_lens=lens.to(torch.int32).cuda(),
        work=work,
        scale=dim**-0.5,
        causal=True,
        block_table=table.cuda(),
        page_size=PAGE,
        block_m=DECODE_BLOCK_M,
    )
    k, v = cache[0].flatten(0, 1), cache[1].flatten(0, 1)
    moved = int(lens.sum()) * kv_heads * dim * 2 * cache.element_size()
    return q, k, v, args, moved


def timed(q, k, v, args, block_n: int, warps: int, stages: int) -> tuple[float, torch.Tensor]:
    out = torch.empty_like(q)

    def attend():
        paged_attention(q, k, v, out, block_n=block_n, launch=(warps, stages), **args)

    attend()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    graph.replay()
    torch.cuda.synchronize()
    return median_us(graph.replay, calls=20), out.clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(), torch.__version__)
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / median_us(lambda: dst.copy_(src)) / 1e3
    print(f"copy {copy_gbps:.0f} GB/s (read + written)")
    for name in SHAPES:
        q, k, v, common, moved = build(name, dtype)
        floor = moved / copy_gbps / 1e3
        base_us, base = timed(q, k, v, common, *COMMITTED)
        print(f"\n{name}: {moved / 1e6:.1f} MB of K/V; floor {floor:.1f} us")
        print("| K/V a step x warps x stages | us | of the floor | max diff |")
        print("|---|---:|---:|---:|")
        print(f"| {COMMITTED} (committed) | {base_us:.1f} | {floor / base_us:.0%} | 0 |")
        for config in SWEEP:
            us, out = timed(q, k, v, common, *config)
            diff = float((out.float() - base.float()).abs().max())
            print(f"| {config} | {us:.1f} | {floor / us:.0%} | {diff:.1e} |")


if __name__ == "__main__":
    main()
