"""Step traces of the engine cores of a benchmark run (V1_STEP_TRACE, `v1.core.step_trace`),
cut at the benchmark's own timed runs and summarized one table row per run."""

from __future__ import annotations

import os

import numpy as np


def enable(directory: str) -> None:
    """Every core started from now on (here or in a child process) writes its step trace."""
    os.makedirs(directory, exist_ok=True)
    os.environ["V1_STEP_TRACE"] = directory


def files(directory: str) -> set[str]:
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def summarize(path: str, spans: list[tuple[float, float]]) -> str:
    """One row per timed run: the steps scheduled between its start and end, both
    `time.perf_counter()` here and in the core's process (one monotonic clock)."""
    rows = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    lines = [
        "| run | s before the first schedule | s (first to last schedule) | s after the last "
        "schedule | steps | encoder steps | inputs per encoder step "
        "(mean, first 3) | decode-only steps | reqs, burst per decode-only step | tokens per step |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for i, (start, end) in enumerate(spans):
        run = rows[(rows[:, 0] >= start) & (rows[:, 0] <= end)] if len(rows) else rows
        if not len(run):
            lines.append(f"| {i} | no steps |")
            continue
        t, _, enc, reqs, tokens, burst, _ = run.T
        encoder_steps = enc[enc > 0]
        decode_only = reqs[enc == 0]
        lines.append(
            f"| {i} | {t[0] - start:.3f} | {t[-1] - t[0]:.3f} | {end - t[-1]:.3f} | {len(run)} | {len(encoder_steps)} | "
            f"{encoder_steps.mean() if len(encoder_steps) else 0:.1f} "
            f"({', '.join(str(int(x)) for x in encoder_steps[:3])}) | {len(decode_only)} | "
            f"{decode_only.mean() if len(decode_only) else 0:.1f}, "
            f"{burst[enc == 0].mean() if len(decode_only) else 0:.1f} | {tokens.mean():.1f} |"
        )
    return "\n".join(lines)
