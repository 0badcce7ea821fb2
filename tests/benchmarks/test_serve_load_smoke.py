"""benchmarks/serve_load.py on CPU against its null server: the load split over client
processes comes back complete, in input order, with the round's figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import ASSETS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.skipif(
    not (ASSETS / "audio").is_dir(), reason="needs the speech clips in ../shared/assets/audio"
)


def test_null_server_load_from_client_processes() -> None:
    procs = 3
    cmd = [sys.executable, str(BENCHMARKS / "serve_load.py"), "--null-server"]
    cmd += ["--num-requests", "10", "--concurrency", "6", "--rounds", "1"]
    cmd += ["--client-procs", str(procs), "--audio-dir", str(ASSETS / "audio")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"Load client processes: {procs}" in out
    assert "round 1: " in out and "errors" not in out
    table = out.split("| ---: |")[-1].strip().splitlines()
    assert len(table) == 1 and table[0].startswith("| 1 | ")
