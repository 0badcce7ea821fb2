"""Where a Whisper decode step's time goes: host phases per step and the device's kernels.

Builds a random large-v3-turbo-shaped Whisper (or large-v3 with --decoder-layers 32), warms the
engine on full-size inputs, then transcribes `--clips` fresh 30 s clips with `--tokens` forced
tokens while timing the EngineCore's host phases (schedule, launch, read-back, update) and
recording a torch profiler trace of the device kernels.

    python benchmarks/profile_step.py --tokenizer ../shared/assets/whisper-base
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def build(args: argparse.Namespace) -> str:
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    cfg = WhisperConfig(
        d_model=1280,
        encoder_layers=32,
        decoder_layers=args.decoder_layers,
        encoder_attention_heads=20,
        decoder_attention_heads=20,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
        num_mel_bins=128,
        vocab_size=51866,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
    )
    with torch.device("cuda"):
        model = WhisperForConditionalGeneration(cfg).half()
    model.generation_config = GenerationConfig.from_pretrained(args.tokenizer)
    path = tempfile.mkdtemp(prefix="whisper-prof-")
    model.save_pretrained(path)
    for item in Path(args.tokenizer).iterdir():
        skip = item.name in ("config.json", "generation_config.json")
        if item.is_file() and not item.name.endswith(".safetensors") and not skip:
            shutil.copy(item, Path(path) / item.name)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def make_engine(path: str, **overrides: Any) -> Any:
    """The in-process engine these scripts profile: 256 requests, 32 windows per encoder step."""
    from v1 import LLM

    args = dict(
        dtype="float16",
        multiprocess=False,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_num_encoder_input_tokens=1500 * 32,
    )
    return LLM(path, **{**args, **overrides})


def clip_maker(num_clips: int) -> Callable[[], list[tuple[np.ndarray, int]]]:
    """A function returning `num_clips` fresh random 30 s clips at 16 kHz each call."""
    rng = np.random.default_rng(0)

    def clips() -> list[tuple[np.ndarray, int]]:
        audio = rng.standard_normal((num_clips, 480_000), dtype=np.float32) * np.float32(0.1)
        return [(a, 16_000) for a in audio]

    return clips


def wrap(
    timings: dict[str, list[float]],
    obj: Any,
    name: str,
    label: str | None = None,
    enabled: Callable[[], bool] | None = None,
) -> None:
    """Times every call of `obj.name` (an instance's or a class's method) into
    timings[label or name], while `enabled()` holds (always without it)."""
    fn = getattr(obj, name)
    key = label or name

    def timed(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if enabled is None or enabled():
                timings[key].append(time.perf_counter() - start)

    setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default="../shared/assets/whisper-base")
    parser.add_argument("--decoder-layers", type=int, default=4)
    parser.add_argument("--clips", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--trace", default=None, help="write a chrome trace here")
    parser.add_argument("--quantization", default=None, help="e.g. fp8")
    parser.add_argument(
        "--cprofile", action="store_true", help="also one run under cProfile (host functions)"
    )
    args = parser.parse_args()

    from v1 import SamplingParams

    llm = make_engine(build(args), quantization=args.quantization)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    clips = clip_maker(args.clips)

    llm.transcribe(
        clips(), params, language="en", temperature=0.0, use_tqdm=False
    )  # warm-up, full size
    core = llm.llm_engine.engine_core.engine_core
    timings: dict[str, list[float]] = collections.defaultdict(list)
    wrap(timings, core.scheduler, "schedule")
    wrap(timings, core.scheduler, "update_from_output")
    runner = core.executor.worker.model_runner
    wrap(timings, runner, "execute_model_async")
    batch_sizes: list[int] = []
    schedule = core.scheduler.schedule

    def counted_schedule() -> Any:
        so = schedule()
        batch_sizes.append(len(so.num_scheduled_tokens))
        return so

    core.scheduler.schedule = counted_schedule
    audio = clips()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"wall {wall:.2f} s for {args.clips} clips x {args.tokens} tokens (profiled)")
    print(
        f"steps {len(batch_sizes)}; batch sizes: max {max(batch_sizes)}, "
        f"median {int(np.median(batch_sizes))}"
    )
    for name, values in timings.items():
        ms = np.array(values) * 1e3
        print(f"{name}: {len(ms)} calls, median {np.median(ms):.2f} ms, total {ms.sum():.0f} ms")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    )
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
        )
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)

    # Unprofiled: the same run's wall time, per-step host phases, and the decode phase's steady
    # state (the last half of the steps, all at full batch): wall per step and how long each
    # read-back waits for the device (~0: host-bound; most of the step: device-bound).
    from v1.worker.sampled_output import HostCopy

    wrap(timings, HostCopy, "get")
    step_ends: list[float] = []
    step = core.step

    def timed_step() -> Any:
        out = step()
        step_ends.append(time.perf_counter())
        return out

    core.step = timed_step
    timings.clear()
    batch_sizes.clear()
    audio = clips()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"unprofiled wall {wall:.2f} s, {len(batch_sizes)} steps")
    half = len(step_ends) // 2
    steady = np.diff(step_ends[half:]) * 1e3
    print(f"decode steady state: {np.median(steady):.2f} ms/step (median of {len(steady)})")
    for name, values in timings.items():
        ms = np.array(values) * 1e3
        tail = ms[len(ms) // 2 :]
        print(
            f"{name}: median {np.median(ms):.2f} ms, p90 {np.percentile(ms, 90):.2f} ms, "
            f"steady-state median {np.median(tail):.2f} ms"
        )
    if args.cprofile:
        import cProfile
        import pstats

        audio = clips()
        profiler = cProfile.Profile()
        profiler.enable()
        llm.transcribe(audio, params, language="en", temperature=0.0, use_tqdm=False)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
    llm.shutdown()


if __name__ == "__main__":
    main()
