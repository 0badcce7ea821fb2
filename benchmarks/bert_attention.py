"""BERT-base attention over bert_embed.py's workload (4096 inputs of 16-512 tokens, 12 heads of
64, fp16), cut into steps of 32,768 tokens / 512 inputs as the engine packs them, inputs in
random or length-sorted order: flash varlen on the packed rows against cuDNN's dense attention
on each step padded to its longest input (with and without the key-padding mask; without it
the result is wrong, an upper bound). Flash varlen also as the engine's encoder CUDA graphs
launch it (`encoder_graphs.graph_offsets`: the step padded to a multiple of 1024 tokens, 544
sequence slots, the grid sized for 512 tokens whatever the step holds), and with that grid
sized for the step's longest input rounded up to a power of two (graphs per length bucket).
The engine's Triton encoder-only kernel (`ops/triton_encoder_attention.py`) on the same
steps, exact and on the graphs' grid. Device time of the 12 layers' calls, median of 5. q/k/v
are strided views of one [T, 3, H, D] projection, as the engine holds them.

`--sweep` times the Triton kernel's tile configurations instead (inputs in random order; with
`--head-size 32 --max-len 256`, MiniLM's shape), after checking it against aten's flash;
`--quick` times the engine's configuration alone, `--inputs N` takes N inputs (4096).

    python3 benchmarks/bert_attention.py
    python3 benchmarks/bert_attention.py --sweep --head-size 32 --max-len 256
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_SIZE, STEP_TOKENS, STEP_INPUTS, LAYERS, MAX_LEN = 12, 64, 32768, 512, 12, 512


def steps(lengths: np.ndarray) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for length in lengths.tolist():
        if sum(out[-1]) + length > STEP_TOKENS or len(out[-1]) == STEP_INPUTS:
            out.append([])
        out[-1].append(length)
    return out


def step_offsets(step: list[int], graph_len: int | None, size: int | None = None) -> np.ndarray:
    """The step's varlen offsets; with `graph_len`, as the engine's graph replays it
    (`graph_offsets`: padded to `size`, default the next multiple of 1024 tokens)."""
    offsets = np.concatenate([[0], np.cumsum(step)])
    if graph_len is None:
        return offsets
    from v1.worker.encoder_graphs import GRAPH_TOKEN_STEP, graph_offsets

    size = size or -(-int(offsets[-1]) // GRAPH_TOKEN_STEP) * GRAPH_TOKEN_STEP
    slots = STEP_INPUTS + -(-GRAPH_TOKEN_STEP // graph_len)
    return graph_offsets(offsets, size, slots, graph_len)


def triton_varlen(q, k, v, cu, longest, config=None):  # noqa: ANN001, ANN201
    """The engine's Triton encoder-only kernel (`ops/triton_encoder_attention.py`), its tile
    table made once per step (outside the timed calls; `tiles_ms` times it)."""
    from v1.attention.ops import triton_encoder_attention as ops
    from v1.attention.ops.encoder_tiles import query_tiles

    rows = config[0] if config else ops.tile_rows(q.shape[2])
    tiles = query_tiles(cu, q.shape[0], rows)
    return lambda: ops.encoder_attention(q, k, v, cu, 0.125, tiles, config)


def step_inputs(
    step: list[int], graph_len: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q, k, v, cu, longest) of a step: q/k/v strided views of one [T, 3, H, D] projection,
    as the engine holds them; with `graph_len`, offsets and grid as the engine's graph replays
    them (the grid sized for that length, at least the step's longest input)."""
    offsets = step_offsets(step, graph_len)
    qkv = torch.randn(int(offsets[-1]), 3, HEADS, HEAD_SIZE, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    return q, k, v, cu, graph_len or max(step)


def varlen(
    kernel: str, step: list[int], graph_len: int | None = None, config: tuple | None = None
) -> Callable[[], object]:
    """A varlen call over the step's rows (`step_inputs`): `kernel` "aten" (aten's flash),
    "fa4" (FA4, flash_attn.cute) or "triton" (ours, `config` its tiles)."""
    from fa4_attention import aten_varlen, fa4_varlen

    q, k, v, cu, longest = step_inputs(step, graph_len)
    if kernel == "triton":
        return triton_varlen(q, k, v, cu, longest, config)
    call = {"aten": aten_varlen, "fa4": fa4_varlen}[kernel]
    return lambda: call(q, k, v, cu, longest)


def triton_check(cut: list[list[int]]) -> str:
    """max|diff| of the Triton kernel to aten flash over the first 5 steps (graph grid too)."""
    from fa4_attention import aten_varlen

    worst = 0.0
    for step in cut[:5]:
        rows = sum(step)
        for graph_len in (None, MAX_LEN):
            q, k, v, cu, longest = step_inputs(step, graph_len)
            ours = triton_varlen(q, k, v, cu, longest)()[:rows]
            ref = aten_varlen(q, k, v, cu, longest)[:rows]
            worst = max(worst, (ours.float() - ref.float()).abs().max().item())
    return f"max|diff| to aten flash {worst:.1e} (5 steps, exact and graph grids)"


def tiles_ms(cut: list[list[int]]) -> float:
    """Device ms of making every step's tile table once (the engine makes it once a step)."""
    from v1.attention.ops import triton_encoder_attention as ops
    from v1.attention.ops.encoder_tiles import query_tiles

    cus = [torch.tensor(step_offsets(s, MAX_LEN), device="cuda", dtype=torch.int32) for s in cut]
    rows = ops.tile_rows(HEAD_SIZE)
    size = STEP_TOKENS + 1024
    return device_ms([lambda cu=cu: query_tiles(cu, size, rows) for cu in cus]) / LAYERS


SWEEP = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for s in (2, 3, 4)]


def fa4_graph_replays(cut: list[list[int]]) -> str:
    """FA4 varlen captured in a CUDA graph on one step's offsets, then replayed after other
    steps' offsets were copied into its buffer (as the engine's encoder graphs replay):
    max|diff| to aten flash on those offsets."""
    from fa4_attention import aten_varlen, fa4_varlen

    size = STEP_TOKENS + 1024
    cu = torch.tensor(step_offsets(cut[0], MAX_LEN, size), device="cuda", dtype=torch.int32)
    q = torch.randn(size, HEADS, HEAD_SIZE, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    out.copy_(fa4_varlen(q, q, q, cu, MAX_LEN))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fa4_varlen(q, q, q, cu, MAX_LEN))
    worst = 0.0
    for step in cut[1:6]:
        cu.copy_(torch.from_numpy(step_offsets(step, MAX_LEN, size)))
        q.normal_()
        graph.replay()
        ref = aten_varlen(q, q, q, cu, MAX_LEN)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
    return f"max|diff| {worst:.1e} over 5 replays on other offsets"


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
    global HEAD_SIZE, MAX_LEN  # the step helpers read them
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import flash_attn.cute  # noqa: F401

        has_fa4 = True
    except ImportError:
        has_fa4 = False
    p = argparse.ArgumentParser(description="BERT attention kernels over bert_embed.py's workload")
    p.add_argument("--sweep", action="store_true", help="time the Triton tile configurations")
    p.add_argument("--quick", action="store_true", help="--sweep: the engine's tiles alone")
    p.add_argument("--head-size", type=int, default=HEAD_SIZE, help="32 for MiniLM's shape")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="longest input (256: MiniLM)")
    p.add_argument("--inputs", type=int, default=4096)
    args = p.parse_args()
    HEAD_SIZE, MAX_LEN = args.head_size, args.max_len
    lengths = np.random.default_rng(0).integers(16, MAX_LEN + 1, size=args.inputs)
    orders = {
        "random": np.random.default_rng(1).permutation(len(lengths)),
        "sorted": np.argsort(-lengths, kind="stable"),
    }
    if args.sweep:
        cut = steps(lengths[orders["random"]])
        print(f"head size {HEAD_SIZE}, inputs of 16-{MAX_LEN} tokens; {triton_check(cut)}")
        print("aten", round(device_ms([varlen("aten", s) for s in cut]), 1), flush=True)
        print(f"tile tables: {tiles_ms(cut):.2f} ms for the {len(cut)} steps")
        configs = SWEEP
        if args.quick:  # the engine's tiles for this head size alone
            from v1.attention.ops.triton_encoder_attention import CONFIGS

            configs = [CONFIGS[HEAD_SIZE]]
        for config in configs:
            try:
                ms = device_ms([varlen("triton", s, None, config) for s in cut])
                graph = device_ms([varlen("triton", s, MAX_LEN, config) for s in cut])
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build
                print("triton", config, "failed:", str(e)[:80])
                continue
            print("triton", config, round(ms, 1), "graph grid", round(graph, 1), flush=True)
        return
    for name, order in orders.items():
        cut = steps(lengths[order])
        exact = device_ms([varlen("aten", s) for s in cut])
        print(f"{name}: {len(cut)} steps; flash varlen {exact:.1f} ms")
        graph = device_ms([varlen("aten", s, MAX_LEN) for s in cut])
        print(f"   flash varlen, the engine's graph grid (512 tokens, 544 slots): {graph:.1f} ms")
        bucket = device_ms(
            [varlen("aten", s, min(MAX_LEN, 1 << (max(s) - 1).bit_length())) for s in cut]
        )
        print(f"   flash varlen, that grid for the longest input's power of two: {bucket:.1f} ms")
        exact, graph = (
            device_ms([varlen("triton", s) for s in cut]),
            device_ms([varlen("triton", s, MAX_LEN) for s in cut]),
        )
        print(f"   Triton (ours) {exact:.1f} ms; on the engine's graph grid {graph:.1f} ms")
        if has_fa4:
            exact, graph = (
                device_ms([varlen("fa4", s) for s in cut]),
                device_ms([varlen("fa4", s, MAX_LEN) for s in cut]),
            )
            print(f"   FA4 varlen {exact:.1f} ms; on the engine's graph grid {graph:.1f} ms")
            print(f"   FA4 varlen in a CUDA graph: {fa4_graph_replays(cut)}")
        for mask in (False, True):
            ms = device_ms([dense(s, mask) for s in cut])
            print(f"   cuDNN dense, padded, mask={mask}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
