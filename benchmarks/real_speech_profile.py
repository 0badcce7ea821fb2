"""Where whisper-base's time goes on real speech (issue 35 items 4 and 7): the real weights on
`_real_speech`'s clips (4.7-11 s, EOS-ended greedy), as `offline.py --workloads
whisper-base-real` runs them, with `LLM(path, dtype="float16")`'s defaults.

Per run of `--num-inputs` clips: the wall and RTFx (timed runs, fresh audio each), every engine
step of one run from the core's step trace (V1_STEP_TRACE: when it was scheduled, encoder
inputs, requests, tokens, burst), a py-spy sample of both processes (`--py-spy`, py-spy on
PATH), and, with the core in this process, one run under the torch profiler: how much of the
wall the device is busy (the union of its kernels' intervals) and the top kernels.

    python3 benchmarks/real_speech_profile.py --model /tmp/whisper-base-real --py-spy $OUT/spy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))

import _trace  # noqa: E402
import numpy as np  # noqa: E402
from _context import asset  # noqa: E402
from _real_speech import load_clips, make_inputs, wer  # noqa: E402
from _spy import start_spy, summarize  # noqa: E402


def run_once(llm: Any, audio: list[np.ndarray]) -> list[str]:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=440)
    outs = llm.transcribe(
        [(a, 16000) for a in audio],
        language="en",
        sampling_params=params,
        temperature=0.0,
        use_tqdm=False,
    )
    return [o.text for o in outs]


def step_table(path: str, span: tuple[float, float]) -> str:
    """Every step the core scheduled within `span`: ms since the run's start, ms since the
    previous step, and the trace's columns."""
    rows = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    run = rows[(rows[:, 0] >= span[0]) & (rows[:, 0] <= span[1])]
    lines = ["| step | t ms | dt ms | new | enc | reqs | tokens | burst | waiting |"]
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prev = span[0]
    for i, (t, new, enc, reqs, tokens, burst, waiting) in enumerate(run):
        lines.append(
            f"| {i} | {(t - span[0]) * 1e3:.1f} | {(t - prev) * 1e3:.1f} | {int(new)} | "
            f"{int(enc)} | {int(reqs)} | {int(tokens)} | {int(burst)} | {int(waiting)} |"
        )
        prev = t
    lines.append(f"end: {(span[1] - span[0]) * 1e3:.1f} ms ({(span[1] - prev) * 1e3:.1f} after)")
    return "\n".join(lines)


SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
    "aten::nonzero",
)
"""Host calls that wait for the device (a blocking copy, a scalar read, a data-dependent size)."""


def print_syncs(prof: Any) -> None:
    """Every host call in SYNCS: calls, total host ms, and the Python stacks that made them."""
    print("\n# host calls that wait for the device")
    for avg in prof.key_averages(group_by_stack_n=12):
        if avg.key not in SYNCS:
            continue
        print(f"{avg.key}: {avg.count} calls, {avg.cpu_time_total / 1e3:.2f} ms")
        for frame in avg.stack[:12]:
            if "v1/" in frame or "benchmarks/" in frame:
                print(f"    {frame}")


def find_syncs(llm: Any, audio: list[np.ndarray]) -> None:
    """One run under torch's CUDA sync debug mode: every operation that waits for the device
    warns; prints how often each v1 call site did."""
    import collections
    import traceback
    import warnings

    import torch

    sites: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if "called a synchronizing CUDA operation" not in str(message):
            return  # torch's one-off notice that the debug mode is a prototype
        frames = [f for f in traceback.extract_stack()[:-1] if "/v1/" in f.filename]
        site = " <- ".join(
            f"{f.filename.split('/v1/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:][::-1]
        )
        sites[f"{str(message)[:60]} @ {site}"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run_once(llm, audio)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    print(f"\n# operations that waited for the device in one run: {sum(sites.values())}")
    for site, n in sites.most_common(25):
        print(f"{n:5d}  {site}")


def busy_union(events: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(events):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


TIMED = (
    "v1.worker.model_runner:ModelRunner._prepare_inputs",
    "v1.worker.model_runner:ModelRunner._update_states",
    "v1.worker.model_states.encoder_decoder:EncoderDecoderState.prepare_step",
    "v1.worker.model_states.encoder_decoder:EncoderDecoderState._run_encoders",
    "v1.worker.model_states.encoder_decoder:EncoderDecoderState._write_cross_kv",
    "v1.worker.model_states.encoder_decoder:EncoderDecoderState._encoder_kwargs",
    "v1.models.whisper:WhisperForConditionalGeneration.encode",
    "v1.models.whisper:WhisperEncoder.forward",
    "v1.audio.features:LogMelSpectrogram.forward",
    "v1.worker.attn_metadata:AttentionMetadataFactory.cross",
    "v1.worker.attn_metadata:AttentionMetadataFactory.uncached",
    "v1.worker.attn_metadata:AttentionMetadataFactory.decoder",
    "v1.worker.model_states.base:GenerationState.finish_step",
    "v1.worker.model_states.base:GenerationState.sample_async",
    "v1.worker.model_states.base:ModelState.on_requests_added",
    "v1.worker.model_states.base:ModelState.on_requests_removed",
    "v1.worker.cuda_graphs:CudaGraphManager.run",
    "v1.core.scheduler.scheduler:Scheduler.schedule",
    "v1.core.scheduler.scheduler:Scheduler.update_from_output",
    "v1.worker.whisper_encoder_graphs:WhisperEncoderGraphs.encode",
    "v1.core.engine_core:EngineCore.add_request",
    "v1.core.engine_core:EngineCore._step_pipelined",
    "v1.engine.llm_engine:LLMEngine.step",
    "v1.engine.output_processor:OutputProcessor.process_outputs",
    "v1.engine.transcription.offline:_SyncRun._start_waiting",
    "v1.engine.transcription.offline:_SyncRun._advance",
    "v1.worker.model_states.encoder_decoder:_audio_to_device",
)
"""Host functions `host_timers` times (module:Class.method or module:function), besides every module's `to_device`."""


def host_timers() -> dict[str, list[float]]:
    """Wraps TIMED and each v1 module's `to_device` with wall-clock timers (`profile_step.wrap`);
    returns the lists of seconds per call that they fill."""
    import collections
    import importlib

    from profile_step import wrap

    import v1.host_copy

    times: dict[str, list[float]] = collections.defaultdict(list)
    for spec in TIMED:
        module, _, attr = spec.partition(":")
        owner, _, name = attr.rpartition(".")
        target = importlib.import_module(module)
        wrap(times, getattr(target, owner) if owner else target, name, attr)
    original = v1.host_copy.to_device
    for name, module in list(sys.modules.items()):
        if name.startswith("v1.") and getattr(module, "to_device", None) is original:
            wrap(times, module, "to_device", f"to_device ({name})")
    return times


def device_profile(
    path: str,
    audio: list[list[np.ndarray]],
    warm: list[np.ndarray],
    dtype: str,
    engine_kwargs: dict[str, Any],
) -> None:
    """The core in this process: one run under host timers, one under the torch profiler,
    each on its own fresh audio (`audio`: two sets; a repeated set would hit the encoder cache)."""
    import torch

    from v1 import LLM

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else lambda: None
    llm = LLM(path, dtype=dtype, multiprocess=False, **engine_kwargs)
    try:
        run_once(llm, warm)
        times = host_timers()
        run_once(llm, warm)  # the wrappers' first calls
        for values in times.values():
            values.clear()
        sync()
        start = time.perf_counter()
        run_once(llm, audio[0])
        sync()
        wall = time.perf_counter() - start
        print(f"\n# core in this process, host timers: wall {wall:.3f} s")
        print("| function | calls | ms a run | us a call |")
        print("|---|---:|---:|---:|")
        for key, values in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            if values:
                total = sum(values)
                print(
                    f"| {key} | {len(values)} | {total * 1e3:.1f} | {total / len(values) * 1e6:.0f} |"
                )
        if not cuda:
            return
        find_syncs(llm, audio[1])
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            start = time.perf_counter()
            run_once(llm, audio[2])
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        busy = busy_union(kernels) / 1e6
        first = min(s for s, _ in kernels) if kernels else 0
        last = max(e for _, e in kernels) if kernels else 0
        print(
            f"\n# core in this process, torch profiler: wall {wall:.3f} s, device busy "
            f"{busy:.3f} s ({busy / wall:.0%}), first to last kernel {(last - first) / 1e6:.3f} s"
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        print_syncs(prof)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    finally:
        llm.shutdown()


def encoder_kwargs(budget: int | None) -> dict[str, Any]:
    """LLM kwargs of an encoder step of `budget` windows (None: the engine's default)."""
    return {} if budget is None else {"max_num_encoder_input_tokens": budget * 1500}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=asset("whisper-base"), help="real whisper-base folder")
    p.add_argument("--audio-dir", default=None)
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--py-spy", default=None, help="folder for a py-spy sample of one more run")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-device-profile", action="store_true")
    p.add_argument("--dtype", default="float16", help="float32 on CPU")
    p.add_argument(
        "--core-lead", default="default", help="list: Transcriber.core_lead values to alternate"
    )
    p.add_argument(
        "--encoder-inputs",
        default="default",
        help="list: windows an encoder step may take (max_num_encoder_input_tokens / 1500); "
        "several build one engine each (memory shared) and alternate their runs",
    )
    p.add_argument(
        "--hash",
        default="frontend",
        help="list: who hashes each window's audio (frontend, as one core does; core: the "
        "core's input thread, as data-parallel cores do), alternating on one engine",
    )
    args = p.parse_args()
    args.leads = [int(x) if x != "default" else None for x in args.core_lead.split(",")]
    args.budgets = [int(x) if x != "default" else None for x in args.encoder_inputs.split(",")]
    args.hashers = args.hash.split(",")
    if not set(args.hashers) <= {"frontend", "core"}:
        p.error("--hash takes frontend and/or core")
    return args


class Engine(NamedTuple):
    llm: Any
    trace: str
    """Its core's step trace file."""
    default_lead: int


def build_engines(args: argparse.Namespace) -> dict[int | None, Engine]:
    """One engine (core in its own process, step trace on) per encoder budget."""
    from v1 import LLM

    engines: dict[int | None, Engine] = {}
    try:
        for budget in args.budgets:
            trace_dir = tempfile.mkdtemp(prefix="v1-real-trace-")
            _trace.enable(trace_dir)
            llm = LLM(
                args.model,
                dtype=args.dtype,
                gpu_memory_utilization=0.85 / len(args.budgets),
                **encoder_kwargs(budget),
            )
            (trace,) = _trace.files(trace_dir)
            os.environ.pop("V1_STEP_TRACE")
            engines[budget] = Engine(llm, os.path.join(trace_dir, trace), llm.transcriber.core_lead)
    except BaseException:
        for engine in engines.values():
            engine.llm.shutdown()
        raise
    return engines


Setting = tuple[int | None, int | None, str]
"""(encoder budget, core_lead, who hashes): None for the engine's default."""


def time_settings(
    args: argparse.Namespace, engines: dict[int | None, Engine], next_set: Callable[[], Any]
) -> tuple[dict[Setting, list[tuple[float, float]]], float]:
    """Every setting's timed runs, alternating so drift hits each alike: (spans, WER of the
    last run)."""
    settings = [(b, lead, h) for b in args.budgets for lead in args.leads for h in args.hashers]
    spans: dict[Setting, list[tuple[float, float]]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for budget, lead, hasher in settings:
            engine = engines[budget]
            engine.llm.transcriber.core_lead = engine.default_lead if lead is None else lead
            engine.llm.llm_engine.input_processor.builder.audio_hash_in_core = hasher == "core"
            batch = next_set()
            start = time.perf_counter()
            texts = run_once(engine.llm, batch.audio)
            spans[budget, lead, hasher].append((start, time.perf_counter()))
    for engine in engines.values():
        engine.llm.transcriber.core_lead = engine.default_lead
        engine.llm.llm_engine.input_processor.builder.audio_hash_in_core = False
    return spans, wer(batch.references, texts)


def report(
    spans: dict[Setting, list[tuple[float, float]]],
    engines: dict[int | None, Engine],
    seconds: float,
) -> None:
    """RTFx per setting, then each setting's step trace and its fastest run's steps."""
    print(
        "| encoder windows a step | core_lead | audio hashed by | RTFx median [min-max] | wall s |"
    )
    print("|---|---|---|---:|---:|")
    for (budget, lead, hasher), runs in spans.items():
        walls = [e - s for s, e in runs]
        engine = engines[budget]
        print(
            f"| {budget or f'default ({engine.llm.llm_engine.config.encoder_budget_inputs})'} | "
            f"{lead or f'default ({engine.default_lead})'} | {hasher} | "
            f"{seconds / statistics.median(walls):,.0f} "
            f"[{seconds / max(walls):,.0f}-{seconds / min(walls):,.0f}] | "
            f"{statistics.median(walls):.3f} |"
        )
    for (budget, lead, hasher), runs in spans.items():
        walls = [e - s for s, e in runs]
        trace = engines[budget].trace
        print(
            f"\n# encoder {budget or 'default'}, core_lead {lead or 'default'}, "
            f"hashed by {hasher}: steps"
        )
        print(_trace.summarize(trace, runs))
        fastest = min(range(len(walls)), key=walls.__getitem__)
        print(f"\n# steps of the fastest run ({walls[fastest]:.3f} s)")
        print(step_table(trace, runs[fastest]))


def spy_run(llm: Any, audio: list[np.ndarray], folder: str, seconds: float, top: int) -> None:
    """One more run under py-spy (both processes), sampled for ~2 + 2 `seconds`."""
    out = os.path.join(folder, "spy.txt")
    spy = start_spy(os.getpid(), out, rate=500, seconds=2 + 2 * seconds)
    start = time.perf_counter()
    run_once(llm, audio)
    wall = time.perf_counter() - start
    _, err = spy.communicate(timeout=60)
    print(f"\n# py-spy, both processes: run {wall:.3f} s while sampled")
    print(summarize(out, top) if os.path.exists(out) else err.decode()[-500:])


def main() -> int:
    args = parse_args()
    clips = load_clips(args.audio_dir)
    fresh = iter(range(10_000))
    sets = {}

    def next_set() -> Any:
        k = next(fresh)
        sets[k] = make_inputs(clips, args.num_inputs, k)
        return sets[k]

    seconds = next_set().seconds
    engines = build_engines(args)
    try:
        for engine in engines.values():
            run_once(engine.llm, sets[0].audio)
        spans, last_wer = time_settings(args, engines, next_set)
        print(
            f"{args.num_inputs} clips, {seconds:.0f} s of audio a run; LLM defaults, core in its "
            f"own process; WER of the last run {last_wer:.2%}"
        )
        report(spans, engines, seconds)
        if args.py_spy:
            first = next(iter(spans.values()))
            med = statistics.median(e - s for s, e in first)
            spy_run(engines[args.budgets[0]].llm, next_set().audio, args.py_spy, med, args.top)
    finally:
        for engine in engines.values():
            engine.llm.shutdown()
    if not args.no_device_profile:
        audio = [next_set().audio for _ in range(3)]
        kwargs = encoder_kwargs(args.budgets[0])
        device_profile(args.model, audio, sets[0].audio, args.dtype, kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
