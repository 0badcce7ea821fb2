"""A `v1 serve` the benchmarks start themselves: wait until its /health answers."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, log: str = "") -> None:
    """Returns once `url`/health answers 200; exits the benchmark if the server dies or takes
    longer than `timeout` seconds (then it is killed). `log`: where its output went, if any."""
    where = f" (see {log})" if log else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}{where}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready in {timeout:.0f} s{where}")
