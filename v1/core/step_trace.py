"""A per-step trace of what the scheduler put in each engine step (V1_STEP_TRACE=DIR): one CSV
line per scheduled step, so two runs of one workload (e.g. the core in this process against
its own process) can be compared step by step. Off unless the variable is set."""

from __future__ import annotations

import itertools
import os
import time
from typing import IO

from v1 import envs
from v1.core.sched_output import SchedulerOutput

COLUMNS = ("t", "new_reqs", "encoder_inputs", "reqs", "tokens", "decode_steps", "waiting")
"""t: `time.perf_counter()` at schedule (CLOCK_MONOTONIC: comparable across the processes of
one machine, so a benchmark can cut the trace at its runs' start and end times); new_reqs:
requests scheduled for the first time; encoder_inputs: encoder inputs run this step; reqs /
tokens: scheduled requests and tokens; decode_steps: the step's decode burst; waiting:
requests left waiting."""

_counter = itertools.count()


class StepTrace:
    """Appends one line per step to DIR/steps-<pid>-<n>.csv (n: this process's nth engine)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"steps-{os.getpid()}-{next(_counter)}.csv")
        # Line-buffered: a core that is killed keeps the lines it wrote.
        self._file: IO[str] = open(path, "w", buffering=1)  # noqa: SIM115 - closed by close()
        self._file.write(",".join(COLUMNS) + "\n")
        self.path = path

    @classmethod
    def from_env(cls) -> StepTrace | None:
        directory = envs.step_trace_dir()
        return cls(directory) if directory else None

    def record(self, so: SchedulerOutput, num_waiting: int) -> None:
        t = time.perf_counter()
        self._file.write(
            f"{t:.6f},{len(so.scheduled_new_reqs)},{len(so.encoder_hashes_to_run)},"
            f"{len(so.num_scheduled_tokens)},{so.total_num_scheduled_tokens},"
            f"{so.num_decode_steps},{num_waiting}\n"
        )

    def close(self) -> None:
        self._file.close()
