"""`v1 batch --task transcribe` on a multi-GPU host without Ray (issue 34): files/s of one
job at data_parallel_size 1 and N over the same folder of audio files, then a restarted job.

Random-weight Whisper large-v3-turbo shapes, WAV files of 30 s noise written once, every job
a fresh `python -m v1 batch` process (its wall time includes process start and model load, as
a user sees it; "steady" excludes the time to the engine's ready line). Restart: a DP job is
killed once its second shard is written and run again; the rerun must skip the written shards
and leave every row written exactly once. Keep the `__main__` guard (DP starts processes).

    python benchmarks/batch_gpus.py --dp 1,2 --files 2048
    python benchmarks/batch_gpus.py --device cpu --tiny --dp 1,2 --files 16   # CPU smoke run
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np
import soundfile as sf
import torch
from _context import asset
from dp_scaling import build_turbo

SAMPLE_RATE = 16000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", default="1,2", help="comma list of data_parallel_size")
    p.add_argument("--files", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=30.0, help="length of each file")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens per 30 s window")
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=512, help="rows per engine call")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--tokenizer", default=asset("whisper-base"))
    p.add_argument("--no-restart", action="store_true", help="skip the restart check")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds per job")
    return p.parse_args(argv)


def write_files(root: str, num_files: int, seconds: float) -> str:
    folder = os.path.join(root, "audio")
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    n = int(seconds * SAMPLE_RATE)
    for i in range(num_files):
        noise = (rng.standard_normal(n) * 0.1).astype(np.float32)
        sf.write(os.path.join(folder, f"clip-{i:05d}.wav"), noise, SAMPLE_RATE, subtype="PCM_16")
    return folder


def batch_command(args: argparse.Namespace, model: str, audio: str, out: str, dp: int) -> list[str]:
    cmd = [sys.executable, "-m", "v1", "batch", "--task", "transcribe", "--input", audio]
    cmd += ["--output", out, "--model", model, "--max-tokens", str(args.max_tokens)]
    cmd += ["--temperature", "0", "--language", "en", "--quiet"]
    cmd += ["--shard-size", str(args.shard_size), "--batch-size", str(args.batch_size)]
    cmd += ["--device", args.device]
    if args.device == "cpu":
        cmd += ["--kv-cache-memory-bytes", str(256 << 20)]
    if dp > 1:
        cmd += ["--data-parallel-size", str(dp)]
    return cmd


def count_rows(out: str) -> tuple[int, int]:
    """(rows, distinct ids) over the written shards."""
    ids = []
    for path in sorted(glob.glob(os.path.join(out, "part-*.jsonl"))):
        with open(path) as f:
            ids += [json.loads(line)["id"] for line in f if line.strip()]
    return len(ids), len(set(ids))


def timed_job(cmd: list[str], limit: float) -> tuple[float, float | None, str]:
    """(wall s, s after the engine was ready or None, the log's tail)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if ready is None and ("ready" in line.lower() or "engine core" in line.lower()):
            ready = time.perf_counter()
        if time.perf_counter() - t0 > limit:
            proc.kill()
            break
    rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {shlex.join(cmd)}\n{''.join(lines[-20:])}")
    return wall, (time.perf_counter() - ready if ready else None), "".join(lines[-5:])


def restart_check(args: argparse.Namespace, model: str, audio: str, out: str, dp: int) -> str:
    """Kill a job once its second shard is written, rerun it: every row once, shards skipped."""
    proc = subprocess.Popen(
        batch_command(args, model, audio, out, dp),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + args.time_limit
    while time.time() < deadline and proc.poll() is None:
        if len(glob.glob(os.path.join(out, "part-*.jsonl"))) >= 2:
            proc.kill()
            break
        time.sleep(0.05)
    proc.wait()
    before = {p: os.path.getmtime(p) for p in glob.glob(os.path.join(out, "part-*.jsonl"))}
    wall, _, tail = timed_job(batch_command(args, model, audio, out, dp), args.time_limit)
    kept = sum(os.path.getmtime(p) == t for p, t in before.items())
    rows, distinct = count_rows(out)
    ok = rows == distinct == args.files and kept == len(before)
    return (
        f"restart (DP {dp}): killed with {len(before)} shard(s) written; the rerun kept them "
        f"untouched ({kept}/{len(before)}), took {wall:.1f} s; rows {rows}, distinct ids "
        f"{distinct}, expected {args.files}: {'OK' if ok else 'FAILED'}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    names = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if args.device.startswith("cuda")
        else ["CPU"]
    )
    print(f"Machine: {', '.join(names)}; torch {torch.__version__}", flush=True)
    print(f"Command: python3 benchmarks/batch_gpus.py {shlex.join(argv)}", flush=True)
    audio_seconds = args.files * args.seconds
    rows = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="v1batch-") as root:
        model = build_turbo(args, root)
        audio = write_files(root, args.files, args.seconds)
        base = None
        sizes = [int(x) for x in args.dp.split(",")]
        for dp in sizes:
            out = os.path.join(root, f"out-dp{dp}")
            try:
                wall, steady, _ = timed_job(
                    batch_command(args, model, audio, out, dp), args.time_limit
                )
            except RuntimeError as e:
                print(e, flush=True)
                rows.append(f"| {dp} | FAILED | | | |")
                failed = True
                continue
            got, distinct = count_rows(out)
            failed |= got != args.files or distinct != args.files
            base = base or args.files / wall
            steady_txt = f"{args.files / steady:,.1f}" if steady else "n/a"
            rows.append(
                f"| {dp} | {args.files / wall:,.1f} | {steady_txt} | "
                f"{audio_seconds / wall:,.0f} | {args.files / wall / base:.2f}x |"
            )
            print(rows[-1], flush=True)
        restart = ""
        if not args.no_restart:
            dp = max(sizes)
            restart = restart_check(args, model, audio, os.path.join(root, "restart"), dp)
            failed |= "FAILED" in restart
            print(restart, flush=True)
    print(f"\n{args.files} files x {args.seconds:g} s, {args.max_tokens} tokens max per window")
    print("| DP | files/s (whole job) | files/s (after ready) | RTFx (whole job) | vs DP 1 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if restart:
        print(restart)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
