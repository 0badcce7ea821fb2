"""Host phases of Whisper decode steps, one timer per EngineCore / runner / sampler call, over the
steady decode window (all clips running), plus (--cprofile) a cProfile of that window.

Random large-v3-turbo-shaped Whisper (--decoder-layers 32: large-v3), in-process, 256 clips of
30 s x 100 forced tokens after a full-size warm-up (CUDA only):

    python3 benchmarks/step_phases.py --tokenizer .bench_assets/whisper-base [--cprofile]
"""

import argparse
import collections
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np
import torch
from profile_step import build, clip_maker, make_engine, wrap


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default=".bench_assets/whisper-base")
    p.add_argument("--decoder-layers", type=int, default=4)
    p.add_argument("--clips", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    from v1 import SamplingParams

    llm = make_engine(build(args))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    clips = clip_maker(args.clips)

    llm.transcribe(clips(), params, language="en", temperature=0.0, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    state = runner.state
    T = collections.defaultdict(list)
    active = [False]

    def timed(obj, name, label=None):
        wrap(T, obj, name, label or f"{type(obj).__name__}.{name}", lambda: active[0])

    from v1.worker.sampled_output import HostCopy, PendingSampledStep

    for o, n in [
        (core, "step"),
        (core.scheduler, "schedule"),
        (core.scheduler, "update_from_output"),
        (runner, "execute_model_async"),
        (runner, "_update_states"),
        (runner, "_prepare_inputs"),
        (state, "prepare_step"),
        (state, "finish_step"),
        (state, "compute_logits"),
        (state.sampling_state, "make_metadata"),
        (state.sampling_state, "append_output_tokens"),
        (state, "sampler"),
        (runner.input_batch, "mark_pending"),
        (runner.input_batch, "resolve_pending"),
        (llm.llm_engine.output_processor, "process_outputs"),
        (llm.llm_engine, "step"),
    ]:
        timed(o, n)
    if runner.cuda_graphs is not None:
        timed(runner.cuda_graphs, "prepare")
        timed(runner.cuda_graphs, "run")
    timed(HostCopy, "__init__", "HostCopy.__init__")
    timed(PendingSampledStep, "get_output", "PendingSampledStep.get_output")
    timed(HostCopy, "get", "HostCopy.get(wait)")
    # Steady window: profile only while the running batch is full.
    sched = core.scheduler
    step_fn = core.step
    for use_prof in [False, True] if args.cprofile else [False]:
        T.clear()
        run_once(
            args,
            llm,
            core,
            sched,
            step_fn,
            T,
            active,
            clips,
            params,
            cProfile.Profile() if use_prof else None,
        )
    llm.shutdown()


def run_once(args, llm, core, sched, step_fn, T, active, clips, params, prof):
    ends = []

    def steady_step():
        full = len(sched.running) >= args.clips and not sched.waiting
        if full and not active[0]:
            active[0] = True
            if prof:
                prof.enable()
        if not full and active[0]:
            active[0] = False
            if prof:
                prof.disable()
        out = step_fn()
        if active[0]:
            ends.append(time.perf_counter())
        return out

    core.step = steady_step
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.transcribe(clips(), params, language="en", temperature=0.0, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if prof and active[0]:
        prof.disable()
    active[0] = False
    d = np.diff(ends) * 1e3
    print(
        f"wall {wall:.3f}s; steady steps {len(ends)}: {np.median(d):.2f} ms/step [p10 {np.percentile(d, 10):.2f} p90 {np.percentile(d, 90):.2f}]"
    )
    for k, v in sorted(T.items(), key=lambda kv: -sum(kv[1])):
        ms = np.array(v) * 1e3
        print(f"  {k:45s} n={len(ms):4d} median {np.median(ms):7.3f} ms  total {ms.sum():8.1f} ms")
    if prof:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(70)
        print(s.getvalue())


if __name__ == "__main__":
    main()
