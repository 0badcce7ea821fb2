"""The one-shot all-reduce of tensor parallelism (v1/distributed/parallel_state.py) on 2 and 4
GPUs: the sum NCCL gives, eagerly and replayed from a CUDA graph, on the shapes of decode
steps; what it does not serve (fp16, odd byte counts, over 1 MiB) goes to NCCL with the same
result. Each rank runs in its own process and checks its own results (exit code 0: all held).
Marked `gpu`; skipped with fewer GPUs than the test needs."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [
    (torch.bfloat16, (1, 4096)),
    (torch.bfloat16, (8, 4096)),
    (torch.bfloat16, (128, 4096)),  # 1 MiB: the largest it serves
    (torch.float32, (3, 1000)),
    (torch.float16, (8, 4096)),  # not its type: NCCL
    (torch.bfloat16, (1, 7)),  # 14 bytes: NCCL
    (torch.bfloat16, (256, 4096)),  # 2 MiB: NCCL
]


def _rank_main(rank: int, world_size: int, init_file: str) -> None:
    import faulthandler
    import sys

    from v1.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    faulthandler.dump_traceback_later(60, exit=True)  # a hung collective shows where

    def say(msg: str) -> None:
        print(f"rank {rank}: {msg}", file=sys.stderr, flush=True)

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, world_size, f"file://{init_file}", device)
    assert tp.one_shot is not None, "the one-shot all-reduce did not start"
    for dtype, shape in SHAPES:
        gen = torch.Generator(device=device).manual_seed(1000 * rank + shape[0])
        x = torch.randn(shape, generator=gen, device=device).to(dtype)
        expected = x.clone()
        torch.distributed.all_reduce(expected)
        say(f"{dtype} {shape}")
        served = tp.one_shot.serves(x)
        assert served == (dtype != torch.float16 and 16 <= x.numel() * x.element_size() <= 1 << 20)
        got = tp.all_reduce(x.clone())
        torch.cuda.synchronize()
        say("eager done")
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
        # Replayed from a CUDA graph, on new values written into the captured input.
        static_in = torch.zeros_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tp.all_reduce(static_in.clone())  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tp.all_reduce(static_in * 1)
        say("captured")
        for scale in (1.0, -2.0):
            static_in.copy_(x * scale)
            graph.replay()
            torch.testing.assert_close(static_out, expected * scale, rtol=1e-2, atol=1e-2)
        torch.cuda.synchronize()
    say("all shapes done")
    destroy_tensor_parallel()
    say("destroyed")


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_shot_all_reduce_matches_nccl(tmp_path: Path, world_size: int) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    init_file = str(tmp_path / "rendezvous")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, init_file)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=75)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world_size, f"rank exit codes {codes} (see the ranks' tracebacks)"
