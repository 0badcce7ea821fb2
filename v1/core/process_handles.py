"""The core process as a multiprocess client holds it: `CoreProcess`, the EngineCore program
it started as its child, or `ForeignProcess`, a core another frontend started that it shares
(`AttachedCore`: `v1 serve --api-server-count`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass

POLL_S = 0.1
"""How often a ForeignProcess is looked at while waited for."""


@dataclass(frozen=True)
class AttachedCore:
    """A core another frontend started, which this client shares (`v1 serve
    --api-server-count`): it binds the addresses that frontend named for it (its
    `frontend_addresses[client_index - 1]`) and never starts or stops the core."""

    pid: int
    input_address: str
    output_address: str
    client_index: int


class ForeignProcess:
    """A core process this client did not start: the part of `CoreProcess`'s interface the
    client uses, watched by pid (its exit code belongs to the process that started it)."""

    owned = False

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie its parent has not reaped yet is gone too.
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
        return True

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(POLL_S)

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else -1

    def wait_exit(self) -> None:
        self.join()

    def terminate(self) -> None:
        pass  # not ours to stop

    kill = terminate

    def close_stdin(self) -> None:
        pass


class CoreProcess:
    """The EngineCore program as a child process, with the part of `multiprocessing.Process`'s
    interface the client uses. Its stdin is a pipe that only this process writes (the config,
    then nothing): the core sees end-of-file once its frontend is gone, however it died.
    Thread-safe: Popen serializes reaping, and a blocked `wait_exit` does not stop `join`."""

    def __init__(
        self,
        program: str,
        args: list[str],
        config_json: str,
        env_overrides: dict[str, str] | None = None,
    ) -> None:
        env = dict(os.environ)
        # The caller's import path, as multiprocessing's spawn would give it (tests and
        # scripts may import executors from next to themselves).
        env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys([*filter(None, sys.path), *env.get("PYTHONPATH", "").split(os.pathsep)])
        ).strip(os.pathsep)
        env.update(env_overrides or {})  # e.g. a data-parallel core's CUDA_VISIBLE_DEVICES
        self.owned = True
        self._popen = subprocess.Popen(
            [sys.executable, "-m", program, *args],
            stdin=subprocess.PIPE,
            env=env,
        )
        self.pid = self._popen.pid
        try:
            self._popen.stdin.write(config_json.encode() + b"\n")  # type: ignore[union-attr]
            self._popen.stdin.flush()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass  # it exited at once: the handshake wait reports the exit code

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; -N after signal N (as multiprocessing)."""
        return self._popen.poll()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()

    def wait_exit(self) -> None:
        """Blocks until the process has exited."""
        self._popen.wait()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            self._popen.stdin.close()  # type: ignore[union-attr]
