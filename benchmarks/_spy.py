"""py-spy for the benchmarks: sample a process and its children per thread (non-blocking,
raw collapsed stacks), then summarize the busiest threads and frames. py-spy must be on PATH
(the device kit installs it from `.whl` into /tmp/site/bin)."""

from __future__ import annotations

import collections
import os
import subprocess
import time


def start_spy(
    pid: int, out: str, rate: int = 200, seconds: float | None = None
) -> subprocess.Popen:
    """py-spy recording `pid` and its subprocesses into `out` for `seconds` (None: until it
    gets SIGINT, when it writes what it sampled)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    cmd = ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking"]
    cmd += ["--rate", str(rate), "--format", "raw", "--output", out]
    if seconds is not None:
        cmd += ["--duration", str(int(seconds))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    return proc


def summarize(raw: str, top: int) -> str:
    """Samples per process / thread, and each one's busiest frames (self and inclusive)."""
    by_thread: collections.Counter[str] = collections.Counter()
    self_frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            # --subprocesses: "process PID:"cmd"" first, then "thread (0x..)" with --threads
            head = []
            for fr in frames:
                if not fr.startswith(("process ", "thread ")):
                    break
                head.append(fr)
            key = " / ".join(
                h.split(":")[0] if h.startswith("process ") else h[:60] for h in head[-2:]
            )
            body = frames[len(head) :]
            n = int(count)
            by_thread[key] += n
            if body:
                self_frames[key][body[-1]] += n
            for fr in set(body):
                incl_frames[key][fr] += n
    total = sum(by_thread.values()) or 1
    lines = [f"{total} samples"]
    for key, n in by_thread.most_common(8):
        lines.append(f"\n## {key}: {n} samples ({100 * n / total:.1f}%)")
        lines.append("self:")
        lines += [f"  {c:6d}  {fr[:150]}" for fr, c in self_frames[key].most_common(top)]
        lines.append("inclusive:")
        lines += [f"  {c:6d}  {fr[:150]}" for fr, c in incl_frames[key].most_common(top)]
    return "\n".join(lines)
