"""Host time of Whisper's steps by phase (encoder steps, the first decode step, decode bursts),
per runner and scheduler function: perf_counter wrappers, no profiler. The profile_step.py
engine (random large-v3-turbo weights, core in this process, 256 clips x 100 forced tokens).
`HostCopy.get` is the wait for the device: most of a step when the core is device-bound.

    python3 benchmarks/burst_host.py --tokenizer ../shared/assets/whisper-base
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import build, clip_maker, make_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default="../shared/assets/whisper-base")
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--clips", type=int, default=256)
    args = parser.parse_args()

    from v1 import SamplingParams
    from v1.worker.sampled_output import HostCopy, PendingSampledStep

    llm = make_engine(build(args))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    clips = clip_maker(args.clips)
    options = dict(language="en", temperature=0.0, use_tqdm=False)
    llm.transcribe(clips(), params, **options)  # warm-up, full size
    core = llm.llm_engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    timings: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    phase = ["encoder"]

    def wrap(obj: Any, name: str, label: str | None = None) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[(phase[0], label or name)].append(time.perf_counter() - start)

        setattr(obj, name, timed)

    execute = runner._execute

    def execute_in_phase(so: Any) -> Any:
        if so.num_decode_steps > 1:
            phase[0] = "burst"
        else:
            phase[0] = "encoder" if so.scheduled_new_reqs else "decode"
        return execute(so)

    runner._execute = execute_in_phase
    wrap(runner, "_execute")
    for name in ("_prepare_inputs", "_main_pass_and_finish", "_update_states"):
        wrap(runner, name)
    wrap(runner.cuda_graphs, "prepare", "graphs.prepare")
    wrap(runner.cuda_graphs, "run", "graphs.run")
    wrap(runner.state, "finish_step")
    wrap(runner.state, "prepare_step")
    if runner.state.sampler_graphs is not None:
        wrap(runner.state.sampler_graphs, "run", "sampler_graphs.run")
    wrap(core.scheduler, "schedule")
    wrap(core.scheduler, "update_from_output")
    wrap(HostCopy, "get", "HostCopy.get")
    wrap(PendingSampledStep, "get_output", "PendingSampledStep.get_output")
    wrap(core, "step", "EngineCore.step")
    for run in range(2):
        timings.clear()
        audio = clips()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.transcribe(audio, params, **options)
        torch.cuda.synchronize()
        print(f"run {run}: wall {time.perf_counter() - start:.3f} s")
    for (name_phase, name), values in sorted(timings.items()):
        ms = np.array(values) * 1e3
        print(
            f"{name_phase:8s} {name:30s} n={len(ms):4d} median {np.median(ms):8.3f} ms "
            f"total {ms.sum():8.1f} ms"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
