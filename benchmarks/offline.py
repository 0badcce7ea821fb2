"""Offline throughput, measured honestly: v1-engine vs transformers in one process on one GPU.

Random weights with the real architectures' shapes (throughput does not depend on weight values),
forced output lengths, fp16, sdpa attention for transformers. For every workload:
- both sides warm up on full-size inputs first (transformers: one full-shape batch per batch
  size, a whole pass for BERT; ours: one whole run), then each figure is the median of
  --repeats (default 3) timed runs, each on fresh inputs of the same shapes (so our encoder and
  prefix caches never serve a later run), printed with its [min-max] spread;
- transformers gets its fastest reasonable setting: its batch size is swept (largest first, until
  throughput falls or --hf-sweep-budget is spent; every point is printed) and its best is the
  baseline. Whisper: `GenerationMixin.generate` on precomputed features (fastest) and
  `model.generate(features, language=, task=)` (user path) at the best batch are both printed;
  the ratio uses the faster; the feature extraction time is printed apart (ours computes log-mel
  on the device inside its timed region). BERT: inputs sorted by length before batching, as
  sentence-transformers' `encode` does. BART/Llama: `generate` with
  min_new_tokens = max_new_tokens, use_cache, greedy;
- a roofline column: the device's GEMM rate and copy bandwidth are measured at the start
  (CUDA events, medians); each workload's floor = max(FLOPs / rate, minimal bytes / bandwidth),
  formulas in `_roofline.py`; "v1/floor" is the fraction of that floor we reach;
- `--check` verifies that both sides produced the same number of tokens (embeddings for BERT)
  per input, and the forced number; the run exits non-zero otherwise. Our counts come from the
  warm-up run (same inputs' shapes and settings as the timed runs).

Our engine runs in this process by default (`--in-process`; `--multiprocess` for the
EngineCore-in-its-own-process path users get from `LLM` by default). Issue 16's modes go to our
`LLM` only when given; each takes a comma list and every combination becomes its own row
("default" leaves the option out): `--cross-attention absorbed,per_layer --kv-cache-dtype
default,fp8`. `--cross-attention` applies to encoder-decoder workloads only. Each row notes the
peak batch our scheduler reached and the KV cache per request (bytes in-process).

    python benchmarks/offline.py --workloads all
    python benchmarks/offline.py --workloads whisper-turbo,whisper-turbo-step --check
    python benchmarks/offline.py --device cpu --tiny --check        # smoke run, seconds

Workloads and their wall time on one H100, estimated from shapes and issue 20's warm figures
(transformers ~2,400 RTFx turbo / ~940 large-v3 at batch 128; ours ~1,600 / ~900); each includes
building and saving the random model (~5-15 s), clip generation and features (~10 s), the
transformers sweep (largest batch first; it stops at the first batch whose first run is >10%
slower than the best, and starts no batch after --hf-sweep-budget, 240 s) and our engine's
start-up (~20-60 s, CUDA graph capture included), warm-up and 3 runs:
- whisper-turbo       256 clips x 100 tokens; HF batches 256/128/64/32   ~2.5 min
- whisper-turbo-step  ours at batch 256: 1+3 runs of 1 and of 101 tokens  ~1.5 min
- whisper-large-v3    256 clips x 100 tokens; HF batches 256/128/64/32   ~4-6 min (HF ~8 s a run)
- whisper-beam        large-v3, 64 clips x beam 5 x 100 tokens; HF 64/32/16   (not yet timed)
- whisper-base-real   REAL whisper-base weights on real speech (LibriSpeech x 2 + JFK, fresh
                      shifted variants), EOS-ended; RTFx, WER of both sides, transcripts that
                      differ; 1024 inputs; HF 1024/512/256/128/64      (not yet timed)
- bart-large          256 x (512 in / 128 out); HF 256/128/64/32        ~1.5 min
- bert-base           4096 inputs of 16-512 tokens; HF 256/128/64/32    ~1 min
- llama-1b            64 x (128 in / 256 out); HF batches 64/32           ~1.5 min
- host-overhead       tiny Llama, batch 64 x 256 steps, eager + graphs   ~1 min
plus ~15 s for imports, CUDA start-up and the GEMM/bandwidth measurement. Each extra variant of
our options adds our part again (Whisper large-v3 ~1.5 min, turbo ~1 min, others < 1 min).
Device commands of at most 9 minutes:
    --workloads whisper-turbo,whisper-turbo-step,bert-base      (~5 min)
    --workloads whisper-large-v3                                 (~5 min)
    --workloads bart-large,llama-1b,host-overhead                (~4 min)
Issue 16's modes, e.g. our side only, with room for larger batches (one command):
    --workloads whisper-large-v3 --no-transformers --cross-attention per_layer,absorbed
    --num-inputs 512 --max-num-seqs 512
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable

# Expandable segments, set before torch starts CUDA: with fixed ones, the second engine of one
# process (e.g. --quantization default,fp8) ran out of memory allocating its KV cache while
# 16 GiB sat reserved in segments that no KV tensor fit (H100, whisper-turbo). Both sides of
# every row run under the same allocator.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from _context import Context, ModelStore, asset
from _harness import Device, Machine, measure_machine
from _report import Row, markdown_table, notes_markdown
from _text import bench_bart, bench_bert, bench_host_overhead, bench_llama
from _whisper import bench_turbo_step, bench_whisper, bench_whisper_beam
from _whisper_real import bench_whisper_base_real

WORKLOADS: dict[str, Callable[[Context], list[Row]]] = {
    "whisper-turbo": lambda ctx: bench_whisper(ctx, "whisper-large-v3-turbo", 4),
    "whisper-turbo-step": bench_turbo_step,
    "whisper-large-v3": lambda ctx: bench_whisper(ctx, "whisper-large-v3", 32),
    "whisper-beam": bench_whisper_beam,
    "whisper-base-real": bench_whisper_base_real,
    "bart-large": bench_bart,
    "bert-base": bench_bert,
    "llama-1b": bench_llama,
    "host-overhead": bench_host_overhead,
}
ENGINE_OPTIONS = ("settings", "process", "cross_attention", "quantization", "kv_cache_dtype")
"""Issue 16's LLM options, passed through only when given. `settings` and `process` are ours:
"defaults" runs `LLM(path, dtype=...)` with nothing else (issue 35 item 1), its core in its own
process unless `process=in`; "tuned" the workload's settings; `process` in|mp overrides where
the core runs for that row."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="all", help=f"all, or a comma list of {list(WORKLOADS)}")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu needs --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny random models, few inputs (smoke)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    p.add_argument("--check", action="store_true", help="exit non-zero unless output sizes match")
    p.add_argument("--tokenizer", default=asset("whisper-base"), help="whisper-base folder")
    p.add_argument(
        "--whisper-base",
        default=None,
        help="real whisper-base folder for whisper-base-real (default: the assets' copy)",
    )
    p.add_argument(
        "--audio-dir", default=None, help="the assets' audio folder (default: found like assets)"
    )
    p.add_argument("--bert-tokenizer", default=asset("all-MiniLM-L6-v2"), help="MiniLM folder")
    p.add_argument("--hf-batches", default=None, help="comma list: sweep exactly these")
    p.add_argument(
        "--hf-sweep-budget", type=float, default=240.0, help="seconds per transformers sweep"
    )
    p.add_argument("--no-transformers", action="store_true", help="our engine only (no ratio)")
    p.add_argument("--num-inputs", type=int, default=None, help="override each workload's count")
    p.add_argument("--max-num-seqs", type=int, default=None, help="our engine's batch limit")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="our engine's decode steps per engine step when all requests decode (bursts)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--in-process",
        dest="multiprocess",
        action="store_false",
        default=False,
        help="our EngineCore in this process (default: one process for both sides)",
    )
    mode.add_argument(
        "--multiprocess",
        dest="multiprocess",
        action="store_true",
        help="our EngineCore in its own process (LLM's default for users)",
    )
    p.add_argument(
        "--settings",
        default=None,
        help="tuned|defaults (list): the workload's engine settings, or none (LLM's defaults)",
    )
    p.add_argument("--process", default=None, help="in|mp (list): where each row's EngineCore runs")
    p.add_argument("--cross-attention", default=None, help="absorbed|per_layer|auto (list)")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (list)")
    p.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8 (list)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    args.names = names
    return args


def engine_variants(args: argparse.Namespace) -> list[dict[str, str]]:
    """Every combination of the given option lists ("default" = leave the option out)."""
    lists = {}
    for option in ENGINE_OPTIONS:
        value = getattr(args, option)
        if value:
            lists[option] = value.split(",")
    variants = []
    for combo in itertools.product(*lists.values()):
        variant = {k: v for k, v in zip(lists, combo, strict=True) if v not in ("default", "tuned")}
        if variant not in variants:
            variants.append(variant)
    return variants or [{}]


def machine_header(machine: Machine, argv: list[str]) -> str:
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import triton

        versions.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    if torch.version.cuda:
        versions.append(f"CUDA {torch.version.cuda}")
    return "\n".join(
        [
            f"Machine: {machine.description}; {', '.join(versions)}",
            f"Measured: GEMM {machine.gemm_flops_per_s / 1e12:,.2f} TFLOP/s "
            f"({machine.gemm_detail}), copy {machine.copy_bytes_per_s / 1e9:,.1f} GB/s "
            f"({machine.copy_detail}); medians of 10",
            f"Command: python3 benchmarks/offline.py {shlex.join(argv)}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    device = Device(args.device)
    if device.is_cuda and not torch.cuda.is_available():
        print("no CUDA device here: use --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    if not device.is_cuda and not args.tiny:
        print("full-size workloads need a GPU; on CPU pass --tiny", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if not device.is_cuda:
        torch.set_num_threads(1)  # tiny ops: one thread is faster, and kinder to shared hosts
    try:
        return _run(args, argv, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: list[str], device: Device) -> int:
    machine = measure_machine(device, small=args.tiny or not device.is_cuda)
    header = machine_header(machine, argv)
    print(header, flush=True)
    ctx = Context(args, device, machine, engine_variants(args), ModelStore())
    rows: list[Row] = []
    try:
        for name in args.names:
            print(f"\n== {name}", flush=True)
            start = time.perf_counter()
            try:
                new_rows = WORKLOADS[name](ctx)
            except Exception as e:  # noqa: BLE001 - report, then go on to the next workload
                traceback.print_exc()
                ctx.failures.append(f"{name}: {type(e).__name__}: {e}")
                new_rows = []
            device.free()
            for row in new_rows:
                print(row.markdown(), flush=True)
                for note in row.notes:
                    print(f"   {note}", flush=True)
            print(f"== {name}: {time.perf_counter() - start:,.1f} s", flush=True)
            rows += new_rows
    finally:
        ctx.store.close()

    print("\n" + header)
    print("\n" + markdown_table(rows))
    print("\n" + notes_markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "gemm_flops_per_s": machine.gemm_flops_per_s,
                    "copy_bytes_per_s": machine.copy_bytes_per_s,
                    "rows": [r.to_json() for r in rows],
                    "mismatches": ctx.mismatches,
                    "failures": ctx.failures,
                },
                f,
                indent=1,
            )
    for failure in ctx.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    for mismatch in ctx.mismatches:
        print(f"MISMATCH: {mismatch}", file=sys.stderr)
    if ctx.failures:
        return 1
    if args.check:
        if ctx.mismatches:
            return 1
        print("\ncheck: every workload's output sizes agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
