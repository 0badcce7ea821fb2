"""FlashAttention-4's CuTe kernels (the `flash-attn-4` package, `flash_attn.cute`) against what
the engine runs today for bidirectional attention without a KV cache, device time only:
- Whisper's encoder (large-v3: 20 heads of 64, 1500 positions), q/k/v strided views of one
  packed qkv projection as the engine holds them: cuDNN's dense fused attention (the engine's
  `_cudnn_dense`), aten's flash varlen, FA4 varlen (uniform offsets) and FA4 dense;
- BERT-base's steps of bert_embed.py's workload (4096 inputs of 16-512 tokens, 12 heads of
  64, steps of 32,768 tokens / 512 inputs), random and length-sorted: aten flash varlen
  against FA4 varlen; then FA4 varlen captured in a CUDA graph and replayed.
Every FA4 output is compared with the reference kernel's on the same inputs.

    python3 benchmarks/fa4_attention.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HALF = torch.float16
SCALE = 0.125


def aten_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int):
    """aten's flash varlen forward (what the engine runs for packed bidirectional rows)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, longest, longest, 0.0, False, False, scale=SCALE
    )[0]


def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int):
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        softmax_scale=SCALE,
    )
    return out[0] if isinstance(out, tuple) else out


def device_ms(fn: Callable[[], object], repeats: int = 7, inner: int = 5) -> tuple[float, float]:
    """(median, spread) ms of one call, over `repeats` timings of `inner` calls each."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return float(np.median(times)), float(max(times) - min(times))


def packed_qkv(tokens: int, heads: int, head: int) -> tuple[torch.Tensor, ...]:
    qkv = torch.randn(tokens, 3 * heads * head, device="cuda", dtype=HALF)
    return tuple(x.view(tokens, heads, head) for x in qkv.split(heads * head, dim=1))


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device="cuda", dtype=torch.int32)


def whisper(batches: list[int]) -> None:
    from flash_attn.cute import flash_attn_func

    heads, head, length = 20, 64, 1500
    print(f"Whisper encoder attention ({heads} heads x {head}, {length} positions), device ms")
    for batch in batches:
        q, k, v = packed_qkv(batch * length, heads, head)
        cu = offsets([length] * batch)
        flops = 4 * batch * heads * length * length * head

        def cudnn(q=q, k=k, v=v, batch=batch) -> torch.Tensor:
            def dense(x: torch.Tensor) -> torch.Tensor:
                return x.unflatten(0, (batch, length)).transpose(1, 2)

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(dense(q), dense(k), dense(v), scale=SCALE)
            return out.transpose(1, 2).reshape(batch * length, heads, head)

        def fa4_dense(q=q, k=k, v=v, batch=batch) -> torch.Tensor:
            views = [x.unflatten(0, (batch, length)) for x in (q, k, v)]
            out = flash_attn_func(*views, softmax_scale=SCALE)
            out = out[0] if isinstance(out, tuple) else out
            return out.flatten(0, 1)

        ref = cudnn()
        row = [f"  batch {batch:>2}:"]
        for name, fn in (
            ("cuDNN", cudnn),
            ("aten flash", lambda q=q, k=k, v=v, cu=cu: aten_varlen(q, k, v, cu, length)),
            ("FA4 varlen", lambda q=q, k=k, v=v, cu=cu: fa4_varlen(q, k, v, cu, length)),
            ("FA4 dense", fa4_dense),
        ):
            try:
                started = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first = time.perf_counter() - started
                ms, spread = device_ms(fn)
                diff = (out.float() - ref.float()).abs().max().item()
                row.append(
                    f"{name} {ms:.3f} (+-{spread:.3f}, {flops / ms / 1e9:.0f} TFLOP/s, "
                    f"first {first:.2f} s, max|diff| {diff:.1e})"
                )
            except Exception as e:  # noqa: BLE001 - report and go on
                row.append(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
        print("\n    ".join(row))


def bert() -> None:
    heads, head, step_tokens, step_inputs = 12, 64, 32768, 512
    lengths = np.random.default_rng(0).integers(16, 513, size=4096)
    orders = {
        "random": np.random.default_rng(1).permutation(4096),
        "sorted": np.argsort(-lengths, kind="stable"),
    }
    print("BERT-base attention over bert_embed.py's workload, 12 layers, device ms")
    for name, order in orders.items():
        steps: list[list[int]] = [[]]
        for n in lengths[order].tolist():
            if sum(steps[-1]) + n > step_tokens or len(steps[-1]) == step_inputs:
                steps.append([])
            steps[-1].append(n)
        calls = [(*packed_qkv(sum(step), heads, head), offsets(step), max(step)) for step in steps]

        def run(kernel: Callable[..., torch.Tensor], calls=calls) -> None:
            for call in calls:
                kernel(*call)

        diff = (fa4_varlen(*calls[0]).float() - aten_varlen(*calls[0]).float()).abs().max().item()
        aten_ms, aten_spread = device_ms(lambda: run(aten_varlen), inner=1)
        fa4_ms, fa4_spread = device_ms(lambda: run(fa4_varlen), inner=1)
        print(
            f"  {name}: {len(steps)} steps; aten flash varlen {12 * aten_ms:.1f} "
            f"(+-{12 * aten_spread:.1f}); FA4 varlen {12 * fa4_ms:.1f} (+-{12 * fa4_spread:.1f});"
            f" max|diff| {diff:.1e}"
        )

    # The engine's encoder graphs replay the varlen call over static buffers, max length fixed.
    q, k, v, cu, _ = calls[0]
    out = torch.empty_like(q)

    def graphed_call() -> None:
        out.copy_(fa4_varlen(q, k, v, cu, 512))

    try:
        graphed_call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_call()
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = aten_varlen(q, k, v, cu, 512)
        diff = (out.float() - ref.float()).abs().max().item()
        print(f"  FA4 in a CUDA graph, replayed on new q: max|diff| {diff:.1e}")
    except Exception as e:  # noqa: BLE001
        print(f"  FA4 in a CUDA graph failed: {type(e).__name__}: {str(e)[:300]}")


def main() -> None:
    started = time.perf_counter()
    import flash_attn.cute as cute_pkg

    print(
        f"flash_attn.cute {cute_pkg.__version__} imported in {time.perf_counter() - started:.1f} s"
        f"; {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    whisper([1, 2, 8, 32])
    bert()


if __name__ == "__main__":
    main()
