"""Data-parallel scaling (issue 34): Whisper turbo-shaped random weights, `LLM(...,
data_parallel_size=N)`, clips-per-GPU x N clips of 30 s x forced tokens, all in one process.

Every engine: one warm-up run on full-size clips, then the median of --repeats timed runs on
fresh clips (no encoder or prefix cache serves a later run), with the [min-max] spread and the
ratio to N = 1 of the same weights. "busy": the calling thread's and the whole frontend
process's CPU time over the wall time. Variants of N > 1 (same call, same clips' shapes) show
what limits DP. DP starts core processes: keep the `__main__` guard.

    python benchmarks/dp_scaling.py --dp 1,2 --quantization default,fp8
    python benchmarks/dp_scaling.py --dp 1,2 --quantization default,fp8 --hash engine,frontend \
        --variants-for fp8      # + fp8 rows with the frontend hashing every clip (as before)
    python benchmarks/dp_scaling.py --device cpu --tiny --dp 1,2      # smoke run on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _context import asset, copy_tokenizer  # noqa: E402
from _whisper import CLIP_SECONDS, make_clips, transcribe_run, whisper_config  # noqa: E402

ENGINE_KWARGS = dict(
    max_num_seqs=512,
    max_num_batched_tokens=8192,
    max_num_encoder_input_tokens=1500 * 32,
    num_scheduler_steps=8,
)
TINY_ENGINE_KWARGS = dict(
    max_num_seqs=16, max_num_batched_tokens=512, max_num_encoder_input_tokens=1500 * 4
)


@dataclass(frozen=True)
class Variant:
    """A setting of one row. `core_threads`: "default" (the engine's), "share" (each core
    process's OMP_NUM_THREADS = the host's CPUs / N) or "all" (= the host's CPUs). `admission`:
    "engine" (the Transcriber as built) or "one-core" (its files per step and max active files
    divided by N: before issue 34). `hash`: "engine" (as built: with N > 1 each core hashes
    the audio it takes, the frontend none; with N = 1 the frontend hashes on all threads),
    "frontend" (the frontend hashes every clip on all threads: the code before the cores did)
    or "one-thread" (the frontend hashes every clip on one thread)."""

    core_threads: str = "default"
    admission: str = "engine"
    hash: str = "engine"

    def describe(self) -> str:
        parts = []
        if self.hash != "engine":
            parts.append(f"hash {self.hash}")
        if self.core_threads != "default":
            parts.append(f"core threads {self.core_threads}")
        if self.admission != "engine":
            parts.append(f"admission {self.admission}")
        return ", ".join(parts)


@dataclass
class RowResult:
    label: str
    dp: int
    clips: int
    seconds: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    process_busy: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def rtfx(self) -> float:
        return CLIP_SECONDS * self.clips / statistics.median(self.seconds)

    def spread(self) -> str:
        work = CLIP_SECONDS * self.clips
        return f"[{work / max(self.seconds):,.0f}-{work / min(self.seconds):,.0f}]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", default=None, help="comma list of N (default 1,2[,4] as GPUs allow)")
    p.add_argument("--quantization", default="default,fp8", help="default and/or fp8 (list)")
    p.add_argument("--clips-per-gpu", type=int, default=None, help="default 512 (tiny: 16)")
    p.add_argument("--tokens", type=int, default=None, help="forced tokens (default 100)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny random Whisper (CPU smoke run)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--num-scheduler-steps", type=int, default=None)
    p.add_argument("--tokenizer", default=asset("whisper-base"), help="whisper-base folder")
    p.add_argument("--core-threads", default="default", help="N > 1: default,share (list)")
    p.add_argument("--admission", default="engine", help="N > 1: engine,one-core (list)")
    p.add_argument("--hash", default="engine", help="engine,frontend,one-thread (list; every N)")
    p.add_argument("--variants-for", default="default", help="weights whose N > 1 get variants")
    p.add_argument("--profile", default=None, help="cProfile one extra N > 1 fp16 run to here")
    p.add_argument("--stats", default=None, help="write each engine's core stats (json) here")
    return p.parse_args(argv)


def build_turbo(args: argparse.Namespace, root: str) -> str:
    """Random-weight Whisper large-v3-turbo shapes (or tiny), saved with whisper-base's
    tokenizer and a feature extractor for its mel bins."""
    from transformers import GenerationConfig, WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as Whisper

    cfg = whisper_config(argparse.Namespace(tiny=args.tiny), 4)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Whisper._from_config(cfg, dtype=dtype).eval()
    model.generation_config = GenerationConfig.from_pretrained(args.tokenizer)
    path = os.path.join(root, "turbo")
    model.save_pretrained(path)
    copy_tokenizer(args.tokenizer, path)
    WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(path)
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


class ClipSource:
    """Fresh clips per run without drawing gigabytes of noise each time: one noise set, scaled
    by another factor per run (other samples, other content hashes: no cache serves them)."""

    def __init__(self, max_clips: int) -> None:
        self.base = make_clips(max_clips, seed=1234)
        self.count = 0

    def next(self, num_clips: int) -> np.ndarray:
        self.count += 1
        return self.base[:num_clips] * np.float32(1.0 + 0.001 * self.count)


def engine_kwargs(args: argparse.Namespace, dp: int, quant: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(TINY_ENGINE_KWARGS if args.tiny else ENGINE_KWARGS)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.num_scheduler_steps:
        kwargs["num_scheduler_steps"] = args.num_scheduler_steps
    if not args.device.startswith("cuda"):
        kwargs["kv_cache_memory_bytes"] = 64 << 20
    if quant == "fp8":
        kwargs.update(quantization="fp8", kv_cache_dtype="fp8")
    if dp > 1:
        kwargs["data_parallel_size"] = dp
    return kwargs


def time_runs(
    args: argparse.Namespace, llm: Any, result: RowResult, clips: ClipSource, tokens: int
) -> None:
    run = transcribe_run(tokens)
    for i in range(1, args.repeats + 1):
        batch = clips.next(result.clips)
        cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        run(llm, batch)
        wall = time.perf_counter() - t0
        result.seconds.append(wall)
        result.busy.append((time.thread_time() - cpu0) / wall)
        result.process_busy.append((time.process_time() - proc0) / wall)
        print(
            f"  run {i}: {wall:.3f} s, {CLIP_SECONDS * result.clips / wall:,.0f} RTFx, frontend "
            f"thread busy {result.busy[-1]:.0%}, process {result.process_busy[-1]:.0%}",
            flush=True,
        )


def profile_run(args: argparse.Namespace, llm: Any, batch: np.ndarray, tokens: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(transcribe_run(tokens), llm, batch)
    print(f"  profiled run: {time.perf_counter() - t0:.3f} s (cProfile on)", flush=True)
    profiler.dump_stats(args.profile)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def run_engine(
    args: argparse.Namespace,
    path: str,
    dp: int,
    quant: str,
    variants: list[Variant],
    clips: ClipSource,
    profile: bool,
    all_stats: dict[str, Any],
) -> list[RowResult]:
    """One engine (its core-thread setting), timed under each admission and hash variant."""
    import v1.audio.clip as clip_module
    from v1 import LLM

    per_gpu = args.clips_per_gpu or (16 if args.tiny else 512)
    tokens = args.tokens or (5 if args.tiny else 100)
    weights = "fp16" if quant == "default" else "fp8 weights + KV"
    results = [
        RowResult(", ".join(filter(None, [weights, v.describe()])), dp, per_gpu * dp)
        for v in variants
    ]
    dtype = "float16" if args.device.startswith("cuda") else "float32"
    saved_threads = os.environ.get("OMP_NUM_THREADS")
    if variants[0].core_threads == "share":
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dp))
    elif variants[0].core_threads == "all":
        os.environ["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    llm = None
    try:
        kwargs = engine_kwargs(args, dp, quant)
        llm = LLM(path, dtype=dtype, device=args.device, multiprocess=True, **kwargs)
        transcriber = llm.transcriber
        built = (transcriber.files_per_step, transcriber.max_active_files)
        one_core = (max(1, built[0] // dp), max(1, built[1] // dp))
        outputs = transcribe_run(tokens)(llm, clips.next(per_gpu * dp))
        print(f"  warm-up: {len(outputs)} results", flush=True)
        for variant, result in zip(variants, results, strict=True):
            admission = one_core if variant.admission == "one-core" else built
            transcriber.files_per_step, transcriber.max_active_files = admission
            print(f"  {result.label}: files per step, max active files = {admission}")
            parallel_bytes = clip_module._PARALLEL_HASH_BYTES
            builder = llm.llm_engine.input_processor.builder
            in_core = builder.audio_hash_in_core
            if variant.hash == "one-thread":
                clip_module._PARALLEL_HASH_BYTES = 1 << 62
            if variant.hash in ("one-thread", "frontend"):
                builder.audio_hash_in_core = False
            try:
                time_runs(args, llm, result, clips, tokens)
            except Exception as e:  # noqa: BLE001 - report, go on with the next variant
                traceback.print_exc()
                result.error = f"{type(e).__name__}: {e}"
            finally:
                clip_module._PARALLEL_HASH_BYTES = parallel_bytes
                builder.audio_hash_in_core = in_core
        transcriber.files_per_step, transcriber.max_active_files = built
        all_stats[f"{results[0].label} N={dp}"] = llm.llm_engine.get_stats()
        if profile:
            profile_run(args, llm, clips.next(per_gpu * dp), tokens)
    except Exception as e:  # noqa: BLE001 - one engine failing must not hide the others
        traceback.print_exc()
        for result in results:
            result.error = result.error or f"{type(e).__name__}: {e}"
    finally:
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
        if llm is not None:
            llm.shutdown()
        llm = None
        gc.unfreeze()
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        gc.freeze()
    return results


def table(rows: list[RowResult]) -> str:
    lines = [
        "| weights | N | clips | RTFx median [min-max] | vs N=1 | frontend busy (thread / process) |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    base: dict[str, float] = {}
    for r in rows:
        if r.error or not r.seconds:
            lines.append(f"| {r.label} | {r.dp} | {r.clips} | FAILED: {r.error} | | |")
            continue
        weights = r.label.split(",")[0]
        if r.dp == 1:
            base[weights] = r.rtfx
        ratio = f"{r.rtfx / base[weights]:.2f}x" if weights in base else "-"
        busy, process = statistics.median(r.busy), statistics.median(r.process_busy)
        lines.append(
            f"| {r.label} | {r.dp} | {r.clips} | {r.rtfx:,.0f} {r.spread()} | {ratio} | "
            f"{busy:.0%} / {process:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    is_cuda = args.device.startswith("cuda")
    if is_cuda and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny", file=sys.stderr)
        return 2
    num_gpus = torch.cuda.device_count() if is_cuda else 0
    if args.dp:
        dps = [int(n) for n in args.dp.split(",")]
    else:
        dps = [n for n in (1, 2, 4) if not is_cuda or n <= num_gpus]
    if is_cuda and max(dps) > num_gpus:
        print(f"skipping N > {num_gpus}: only {num_gpus} GPUs", flush=True)
        dps = [n for n in dps if n <= num_gpus]
    names = [torch.cuda.get_device_name(i) for i in range(num_gpus)] if is_cuda else ["CPU"]
    header = (
        f"Machine: {', '.join(names)}; {os.cpu_count()} CPUs; torch {torch.__version__}\n"
        f"Command: python3 benchmarks/dp_scaling.py {shlex.join(argv)}"
    )
    print(header, flush=True)
    per_gpu = args.clips_per_gpu or (16 if args.tiny else 512)
    tokens = args.tokens or (5 if args.tiny else 100)
    rows: list[RowResult] = []
    all_stats: dict[str, Any] = {}
    clips = ClipSource(per_gpu * max(dps))
    thread_modes, admissions = args.core_threads.split(","), args.admission.split(",")
    hashes = args.hash.split(",")
    with tempfile.TemporaryDirectory(prefix="v1dp-") as root:
        path = build_turbo(args, root)
        for quant in args.quantization.split(","):
            for dp in dps:
                varied = dp > 1 and quant in args.variants_for.split(",")
                for mode in thread_modes if varied else ["default"]:
                    variants = [
                        Variant(mode, a, h)
                        for a in (admissions if varied else ["engine"])
                        for h in (hashes if quant in args.variants_for.split(",") else ["engine"])
                    ]
                    print(f"\n== {quant}, data_parallel_size={dp}, {variants}", flush=True)
                    start = time.perf_counter()
                    profile = bool(args.profile) and varied and mode == thread_modes[-1]
                    rows += run_engine(args, path, dp, quant, variants, clips, profile, all_stats)
                    print(f"== {time.perf_counter() - start:.1f} s", flush=True)
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(all_stats, f, indent=1, default=str)
    print(
        f"\n{header}\n{per_gpu} clips of 30 s per GPU x {tokens} forced tokens, median of "
        f"{args.repeats} runs on fresh clips after a full-size warm-up\n"
    )
    print(table(rows))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
