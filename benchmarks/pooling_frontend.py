"""The frontend process's CPU for an offline pooling batch over a core process (issue 35):
`LLM.embed` of 4,096 token-id inputs of 16-256 tokens with a tiny random BERT (hidden 32,
1 layer; `pooling_host.build`), so the frontend's per-request host work (processing, output
registration, sending, reading outputs) is what the figure measures. Prints the wall and the
frontend process's CPU time per run (median of --runs after a full-size warm-up); the core's
work runs in its own process. Compare two trees by running each with PYTHONPATH=<tree>.

    python3 benchmarks/pooling_frontend.py --tokenizer ../shared/assets/all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pooling_host  # noqa: E402
import torch  # noqa: E402
from _context import asset  # noqa: E402
from pooling_host import build, inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=asset("all-MiniLM-L6-v2"))
    parser.add_argument("--inputs", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--arrays", action="store_true", help="token ids as numpy arrays (default: lists)"
    )
    parser.add_argument(
        "--cprofile", action="store_true", help="then one more run under cProfile (frontend)"
    )
    args = parser.parse_args()
    pooling_host.ARRAYS = args.arrays
    torch.set_num_threads(1)
    import v1
    from v1 import LLM

    llm = LLM(
        build(args.tokenizer, 32),
        dtype="float32",
        device="cpu",
        multiprocess=True,
        max_num_seqs=512,
        max_num_batched_tokens=32768,
    )
    try:
        llm.embed(inputs(args.inputs, 0, 256), use_tqdm=False)
        walls, cpus = [], []
        for run in range(args.runs):
            batch = inputs(args.inputs, run + 1, 256)
            wall, cpu = time.perf_counter(), time.process_time()
            llm.embed(batch, use_tqdm=False)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        if args.cprofile:
            import cProfile
            import pstats

            batch = inputs(args.inputs, args.runs + 1, 256)
            profiler = cProfile.Profile()
            profiler.enable()
            llm.embed(batch, use_tqdm=False)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    finally:
        llm.shutdown()
    print(
        f"{v1.__file__}: {args.inputs} inputs, wall median {statistics.median(walls):.3f} s; "
        f"frontend process CPU median {statistics.median(cpus) * 1e3:.1f} ms "
        f"[{min(cpus) * 1e3:.1f}-{max(cpus) * 1e3:.1f}], "
        f"{statistics.median(cpus) / args.inputs * 1e6:.1f} us per input",
        flush=True,
    )


if __name__ == "__main__":
    main()
