"""Turbo fp8 (random large-v3-turbo weights, in-process, 256 clips x 30 s x 100 forced tokens):
per run the wall time, the encoder and decode steps' GPU spans, every GPU gap between steps of
more than 0.3 ms (with the host time before and during that step's launch) and Python's GC
pauses (gc.callbacks). --modes lists the runs: "normal", or "gc-off" (cyclic GC disabled for
the run); --cprofile adds a cProfile of one more run. CUDA only.

    python3 benchmarks/step_gaps.py --tokenizer .bench_assets/whisper-base \\
        --modes normal,gc-off,normal,gc-off,normal,gc-off
"""

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch
from profile_step import build, clip_maker, make_engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default=".bench_assets/whisper-base")
    p.add_argument("--decoder-layers", type=int, default=4)
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--kv", default=None, help="kv_cache_dtype")
    p.add_argument("--modes", default="normal,normal,normal,gc-off,gc-off")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-steps-in-flight", type=int, default=2)
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="decode bursts")
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    from v1 import SamplingParams

    kw = {
        "quantization": "fp8",
        "max_num_seqs": args.max_num_seqs,
        "max_steps_in_flight": args.max_steps_in_flight,
        "num_scheduler_steps": args.num_scheduler_steps,
    }
    if args.kv:
        kw["kv_cache_dtype"] = args.kv
    llm = make_engine(build(args), **kw)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    clips = clip_maker(args.clips)

    def transcribe() -> None:
        llm.transcribe(clips(), params, language="en", temperature=0.0, use_tqdm=False)

    transcribe()  # warm-up, full size
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    launch = runner.execute_model_async
    steps: list[tuple] = []  # (start event, end event, encoders, host start, host end)
    pauses: list[tuple[float, float]] = []  # GC (start, seconds)
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append((gc_start[0], time.perf_counter() - gc_start[0]))

    def timed(so):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        out = launch(so)
        e.record()
        steps.append((s, e, len(so.encoder_hashes_to_run), t0, time.perf_counter()))
        return out

    gc.callbacks.append(on_gc)
    runner.execute_model_async = timed
    for rep, mode in enumerate(args.modes.split(",")):
        steps.clear()
        pauses.clear()
        audio = clips()
        torch.cuda.synchronize()
        if mode == "gc-off":
            gc.disable()
        t0 = time.perf_counter()
        llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        gc.enable()
        idle = enc = dec = 0.0
        gaps = []
        for i, (s, e, nenc, h0, h1) in enumerate(steps):
            span = s.elapsed_time(e)
            enc, dec = (enc + span, dec) if nenc else (enc, dec + span)
            gap = steps[i - 1][1].elapsed_time(s) if i else 0.0
            idle += max(gap, 0.0)
            if gap > 0.3:  # ms
                before = (h0 - steps[i - 1][4]) * 1e3
                gaps.append((i, round(gap, 2), round(before, 2), round((h1 - h0) * 1e3, 2)))
        print(
            f"rep {rep} {mode}: wall {wall:.3f}s RTFx {args.clips * 30 / wall:.0f}; first launch "
            f"{steps[0][3] - t0:.3f}s; steps {len(steps)}; idle {idle / 1e3:.3f}s; enc GPU "
            f"{enc / 1e3:.3f}s dec GPU {dec / 1e3:.3f}s; after last {t0 + wall - steps[-1][4]:.3f}s"
        )
        print("  gaps (step, ms, host since the last launch ms, launch ms):", gaps)
        long = [(round((t - t0) * 1e3, 1), round(d * 1e3, 2)) for t, d in pauses if d > 2e-4]
        total = sum(d for _, d in pauses) * 1e3
        print(f"  gc pauses > 0.2 ms (at ms, ms): {long}; {len(pauses)} in all, {total:.1f} ms")
    runner.execute_model_async = launch
    if args.cprofile:
        profile = cProfile.Profile()
        audio = clips()
        torch.cuda.synchronize()
        profile.enable()
        llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
        torch.cuda.synchronize()
        profile.disable()
        for key, rows in (("cumulative", 45), ("tottime", 30)):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(rows)
            print(text.getvalue())
    llm.shutdown()


if __name__ == "__main__":
    main()
