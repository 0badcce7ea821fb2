"""A window of a worker's steps under torch.profiler (V1_TORCH_PROFILER_DIR), written as a
per-kernel table per rank: where a step's device time goes (e.g. NCCL's share under TP)."""

from __future__ import annotations

import os

import torch

from v1 import envs
from v1.logger import init_logger

logger = init_logger(__name__)


class StepProfiler:
    """Counts steps; profiles steps [start, stop) and writes DIR/rank<R>.txt at stop."""

    def __init__(self, out_dir: str, rank: int, start: int, stop: int) -> None:
        if not 0 <= start < stop:
            raise ValueError(f"V1_TORCH_PROFILER_STEPS needs 0 <= START < STOP, got {start}:{stop}")
        self.out_dir, self.rank, self.start, self.stop = out_dir, rank, start, stop
        self.num_steps = 0
        self._prof: torch.profiler.profile | None = None

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler | None:
        out_dir = envs.torch_profiler_dir()
        if out_dir is None:
            return None
        return cls(out_dir, rank, *envs.torch_profiler_steps())

    def before_step(self) -> None:
        if self.num_steps == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        self.num_steps += 1

    def after_step(self) -> None:
        if self._prof is None or self.num_steps < self.stop:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # sync: the window's kernels end inside it
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.write(prof)

    def write(self, prof: torch.profiler.profile) -> None:
        events = prof.key_averages()
        use_cuda = any(getattr(e, "device_time_total", 0) > 0 for e in events)
        key = "device_time_total" if use_cuda else "self_cpu_time_total"
        total = sum(getattr(e, "self_device_time_total" if use_cuda else key, 0) for e in events)
        nccl = sum(
            getattr(e, "self_device_time_total" if use_cuda else key, 0)
            for e in events
            if any(word in e.key.lower() for word in ("nccl", "allreduce", "all_reduce"))
        )
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{self.rank}.txt")
        share = nccl / total if total else 0.0
        with open(path, "w") as f:
            f.write(
                f"steps {self.start}:{self.stop}, rank {self.rank}; "
                f"{'device' if use_cuda else 'cpu'} time {total / 1e3:.2f} ms, "
                f"NCCL/all-reduce {nccl / 1e3:.2f} ms ({share:.1%})\n\n"
            )
            f.write(
                events.table(
                    sort_by="self_device_time_total" if use_cuda else "self_cpu_time_total",
                    row_limit=40,
                )
            )
        logger.info(
            "step profile of rank %d written to %s (NCCL share %.1f%%)",
            self.rank,
            path,
            100 * share,
        )
