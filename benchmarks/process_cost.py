"""What running the EngineCore in its own process costs offline Whisper (issue 35 item 1):
`LLM.transcribe` with the core in this process against the same engine with the core in its own
process (LLM's default), alternating, on one set of random large-v3-turbo weights, 30 s clips x
forced tokens, fresh clips every run. With `--py-spy DIR` (py-spy on PATH), one more run of
each is sampled by py-spy (non-blocking, both processes, per thread), and the busiest frames
of each process and thread are printed.

    python3 benchmarks/process_cost.py --clips 256 --repeats 3 --py-spy $OUT/spy
    python3 benchmarks/process_cost.py --device cpu --tiny --clips 4 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from _context import asset  # noqa: E402
from _spy import start_spy, summarize  # noqa: E402
from _whisper import CLIP_SECONDS, transcribe_run  # noqa: E402
from dp_scaling import ENGINE_KWARGS, TINY_ENGINE_KWARGS, ClipSource, build_turbo  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--py-spy", default=None, help="folder for py-spy's raw profiles")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    from v1 import LLM

    args.tokenizer = asset("whisper-base")
    root = tempfile.mkdtemp(prefix="v1proc-")
    try:
        path = build_turbo(args, root)
        kwargs: dict[str, Any] = dict(TINY_ENGINE_KWARGS if args.tiny else ENGINE_KWARGS)
        kwargs["max_num_seqs"] = max(args.clips, kwargs["max_num_seqs"] // 2)
        # Both engines live at once: each gets a fixed KV pool (turbo: ~6 MiB a request).
        kwargs["kv_cache_memory_bytes"] = (8 << 30) if args.device.startswith("cuda") else 64 << 20
        dtype = "float16" if args.device.startswith("cuda") else "float32"
        run = transcribe_run(args.tokens)
        clips = ClipSource(args.clips)
        engines = {
            mode: LLM(path, dtype=dtype, device=args.device, multiprocess=mode == "mp", **kwargs)
            for mode in ("in", "mp")
        }
        try:
            for llm in engines.values():
                run(llm, clips.next(args.clips))  # warm-up on full-size clips
            walls: dict[str, list[float]] = {mode: [] for mode in engines}
            for _ in range(args.repeats):
                for mode, llm in engines.items():
                    batch = clips.next(args.clips)
                    start = time.perf_counter()
                    run(llm, batch)
                    walls[mode].append(time.perf_counter() - start)
            audio = args.clips * CLIP_SECONDS
            print(f"\n{args.clips} clips x {args.tokens} tokens, engine {kwargs}, alternating")
            print("| core | RTFx median [min-max] | wall s |")
            print("|---|---:|---:|")
            for mode, w in walls.items():
                print(
                    f"| {'this process' if mode == 'in' else 'own process'} | "
                    f"{audio / statistics.median(w):,.0f} [{audio / max(w):,.0f}-"
                    f"{audio / min(w):,.0f}] | {statistics.median(w):.3f} |"
                )
            if args.py_spy:
                os.makedirs(args.py_spy, exist_ok=True)
                for mode, llm in engines.items():
                    batch = clips.next(args.clips)
                    seconds = 2 + 1.5 * statistics.median(walls[mode])
                    out = os.path.join(args.py_spy, f"{mode}.txt")
                    spy = start_spy(os.getpid(), out, rate=250, seconds=seconds)
                    start = time.perf_counter()
                    run(llm, batch)
                    wall = time.perf_counter() - start
                    _, err = spy.communicate(timeout=seconds + 30)
                    print(f"\n# py-spy, core {mode}: run {wall:.3f} s while sampled")
                    if os.path.exists(out):
                        print(summarize(out, args.top))
                    else:
                        print(f"py-spy wrote nothing: {err.decode()[-500:]}")
        finally:
            for llm in engines.values():
                llm.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
