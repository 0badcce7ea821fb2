"""Absorbed cross-attention kernel alone at Whisper large-v3 decode shapes (CUDA only).

B requests x 1 token, 20 heads, d = 1280, 1500 encoder positions in the engine's paged layout
(blocks of 32 positions in each of `--span` pool tensors, random block order), with the engine's
decode metadata (16-token work items) and replayed from a CUDA graph: microseconds per call of
the CUDA kernel (`cuda_absorbed.py`, 16-bit states; `--cuda-configs` sweeps its positions per
step and stages) and the Triton kernel (16-bit and fp8 states), the GB/s of E each reaches, and
one plain read of the same bytes (the floor). Checks three requests against a torch reference.

    python3 benchmarks/absorbed_kernel.py --batch 256 --dtype float16 --cuda-configs 32x2,16x4
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from v1.attention.backends.triton import DECODE_BLOCK_M
from v1.attention.ops.absorbed_cross_attention import states_index
from v1.attention.ops.cuda_absorbed import attend_encoder_states_cuda, kernel_for
from v1.attention.ops.triton_absorbed import attend_encoder_states_triton

HEADS, D_MODEL, POSITIONS, ROWS_PER_HALF = 20, 1280, 1500, 16
SPAN = 32
"""Pool tensors a states block spreads over: large-v3's 32 decoder layers."""


def median_us(fn, calls: int = 10, repeats: int = 5) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1000)
    return sorted(times)[len(times) // 2]


def run(
    batch: int,
    fp8: bool,
    model_dtype: torch.dtype = torch.bfloat16,
    span: int = SPAN,
    cuda_config: tuple[int, int] | None = None,
    heads: int = HEADS,
) -> dict[str, float]:
    """One kernel: Triton, or the CUDA one at (positions per step, stages); `heads` query rows
    per request (more than 16 take the CUDA kernel's 32-row tiles)."""
    dev = "cuda"
    block = span * 2 * ROWS_PER_HALF
    per_req = -(-POSITIONS // block)
    num_blocks = 1 + batch * per_req
    dtype = torch.float8_e4m3fn if fp8 else model_dtype
    shape = (span, 2, num_blocks, ROWS_PER_HALF)
    states = (torch.randn(*shape, D_MODEL, device=dev) * 0.5).to(dtype)
    scales = torch.rand(*shape, device=dev) + 0.5 if fp8 else None
    table = (torch.randperm(num_blocks - 1, device=dev) + 1)[: batch * per_req]
    table = table.view(batch, per_req).to(torch.int32)
    q = (torch.randn(batch, heads, D_MODEL, device=dev) * 0.03).to(model_dtype)
    common = SimpleNamespace(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), POSITIONS, dtype=torch.int32, device=dev),
        block_table=table,
        max_query_len=1,
    )
    work = (
        torch.arange(batch, dtype=torch.int32, device=dev),
        torch.zeros(batch, dtype=torch.int32, device=dev),
    )
    # The engine's decode metadata: work items of up to 16 query tokens (one used), replayed
    # from a CUDA graph.
    metadata = SimpleNamespace(common=common, work=work, block_m=DECODE_BLOCK_M)
    if cuda_config is None:

        def attend():
            return attend_encoder_states_triton(q, states, scales, metadata)
    else:
        built = kernel_for(q, states, scales, cuda_config)
        assert built is not None, f"the CUDA kernel does not take {cuda_config} (fp8 {fp8})"

        def attend():
            return attend_encoder_states_cuda(q, states, scales, metadata, *built)

    out = attend()
    pos = torch.arange(POSITIONS, device=dev)
    error = 0.0
    for r in (0, batch // 2, batch - 1):
        index = states_index(table[r, pos // block].long() * block + pos % block, states)
        e = states[index].float()
        if scales is not None:
            e = e * scales[index][:, None]
        ref = torch.softmax(q[r].float() @ e.T, -1) @ e
        error = max(error, float((out[r].float() - ref).abs().max()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = attend()
    graph.replay()
    assert torch.equal(graph_out, out), "graph replay differs from the eager call"
    kernel_us = median_us(graph.replay)
    flat = states.view(-1).view(torch.uint8).view(torch.float32)
    floor_us = median_us(lambda: flat.sum())
    e_bytes = batch * POSITIONS * D_MODEL * states.element_size()
    return {
        "kernel_us": kernel_us,
        "kernel_GBps": e_bytes / kernel_us / 1e3,
        "read_floor_us": floor_us * e_bytes / states.numel() / states.element_size(),
        "max_abs_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="the model's: bfloat16 or float16")
    parser.add_argument("--span", type=int, default=SPAN, help="pool tensors a block spans")
    parser.add_argument(
        "--cuda-configs",
        default="16x2",
        help="CUDA kernel builds to time: positions per step x stages, comma-separated",
    )
    parser.add_argument("--heads", type=int, default=HEADS, help="query rows per request")
    parser.add_argument("--no-triton", action="store_true", help="time the CUDA kernel only")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cuda_configs = [tuple(map(int, c.split("x"))) for c in args.cuda_configs.split(",") if c]
    variants = [] if args.no_triton else [("triton", False, None), ("triton", True, None)]
    variants += [(f"cuda {n}x{s}", fp8, (n, s)) for n, s in cuda_configs for fp8 in (False, True)]
    for name, fp8, config in variants:
        try:
            row = run(args.batch, fp8, dtype, args.span, config, args.heads)
        except AssertionError as exc:  # a build that does not fit this device
            print(f"{name}, {'fp8 E' if fp8 else args.dtype}: skipped ({exc})")
            continue
        print(
            f"{name}, {'fp8 E' if fp8 else args.dtype} batch {args.batch} x {args.heads} heads: "
            f"{row['kernel_us']:.0f} us/call ({row['kernel_GBps']:.0f} GB/s of E), "
            f"one read of E {row['read_floor_us']:.0f} us, max abs error {row['max_abs_error']:.1e}"
        )


if __name__ == "__main__":
    main()
