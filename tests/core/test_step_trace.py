"""V1_STEP_TRACE: the core writes one CSV line per scheduled step (the trace process_cost.py
compares between an in-process and a separate-process core)."""

from __future__ import annotations

import csv

from tests.core.fakes import make_engine_core, make_request, to_core_request
from tests.core.test_engine_core import drain
from v1.core.step_trace import COLUMNS


def test_trace_has_one_line_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("V1_STEP_TRACE", str(tmp_path))
    core = make_engine_core(max_num_seqs=4)
    core.add_request(to_core_request(make_request("a", prompt_len=5, max_tokens=3)))
    core.add_request(to_core_request(make_request("b", prompt_len=7, max_tokens=2)))
    drain(core)
    path = core._trace.path
    core.shutdown()
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS
    scheduled = [r for r in rows if int(r["tokens"]) > 0]
    assert len(scheduled) == 3  # the two prompts together, then two decode steps
    assert int(scheduled[0]["new_reqs"]) == 2 and int(scheduled[0]["tokens"]) == 5 + 7
    assert [int(r["reqs"]) for r in scheduled[1:]] == [2, 1]
    times = [float(r["t"]) for r in rows]
    assert times == sorted(times)


def test_no_trace_without_the_variable(monkeypatch):
    monkeypatch.delenv("V1_STEP_TRACE", raising=False)
    assert make_engine_core()._trace is None
