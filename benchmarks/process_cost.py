"""What running the EngineCore in its own process, and LLM's default settings, cost offline
Whisper (issue 35 item 1): `LLM.transcribe` on engines that all live at once, timed in turn
(round-robin, so drift hits every engine alike), on one set of random large-v3-turbo weights,
30 s clips x forced tokens, fresh clips every run. `--modes` picks the engines: `in` / `mp`
the tuned settings with the core in this process / its own process (LLM's default);
`defaults-in` / `defaults-mp` `LLM(path, dtype=...)` with nothing else but a fixed KV pool;
`defaults-mp-whole` as `defaults-mp` with the run's whole first step budget sent in its first
message (as before `offline.FIRST_FILES`).
With `--py-spy DIR` (py-spy on PATH), one more run of each is sampled by py-spy (non-blocking,
both processes, per thread), and the busiest frames of each process and thread are printed.
With `--trace DIR`, every core writes its step trace (V1_STEP_TRACE, `v1.core.step_trace`) and
each timed run's steps are summarized: how many steps, how many encoder inputs per encoder
step, how many requests per decode step.

    python3 benchmarks/process_cost.py --clips 256 --repeats 3 --trace $OUT/trace
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

import _trace  # noqa: E402
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
    p.add_argument("--modes", default="in,mp", help="comma list of " + ",".join(MODES))
    p.add_argument("--trace", default=None, help="folder for the cores' step traces")
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
        modes = args.modes.split(",")
        if unknown := set(modes) - set(MODES):
            raise SystemExit(f"unknown --modes {sorted(unknown)}; choose from {MODES}")
        if args.trace:
            _trace.enable(args.trace)
        defaults = {"kv_cache_memory_bytes": kwargs["kv_cache_memory_bytes"]}
        engines = {}
        traces = {}
        for mode in modes:
            before = (
                set(os.listdir(args.trace)) if args.trace and os.path.isdir(args.trace) else set()
            )
            engines[mode] = LLM(
                path,
                dtype=dtype,
                device=args.device,
                multiprocess="mp" in mode.split("-"),
                **(defaults if mode.startswith("defaults") else kwargs),
            )
            if mode.endswith("whole"):  # the whole first step budget in the first message
                engines[mode].transcriber.first_files = 1 << 30
            if args.trace:
                (traces[mode],) = _trace.files(args.trace) - before
        try:
            for llm in engines.values():
                run(llm, clips.next(args.clips))  # warm-up on full-size clips
            walls: dict[str, list[float]] = {mode: [] for mode in engines}
            spans: dict[str, list[tuple[float, float]]] = {mode: [] for mode in engines}
            for _ in range(args.repeats):
                for mode, llm in engines.items():
                    batch = clips.next(args.clips)
                    start = time.perf_counter()
                    run(llm, batch)
                    spans[mode].append((start, time.perf_counter()))
                    walls[mode].append(spans[mode][-1][1] - start)
            audio = args.clips * CLIP_SECONDS
            print(f"\n{args.clips} clips x {args.tokens} tokens, engine {kwargs}, alternating")
            print("| engine | RTFx median [min-max] | wall s |")
            print("|---|---:|---:|")
            for mode, w in walls.items():
                print(
                    f"| {MODES[mode]} | "
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
        if args.trace:
            for mode, name in traces.items():
                print(f"\n# step trace, {MODES[mode]} ({name}), the timed runs")
                print(_trace.summarize(os.path.join(args.trace, name), spans[mode]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


MODES = {
    "in": "tuned, core in this process",
    "mp": "tuned, core in its own process",
    "defaults-in": "defaults, core in this process",
    "defaults-mp": "defaults, core in its own process (LLM's default)",
    "defaults-mp-whole": "defaults, own process, first budget in one message (before FIRST_FILES)",
}


if __name__ == "__main__":
    sys.exit(main())
