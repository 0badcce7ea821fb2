"""`v1 serve`'s processes: `run_server` starts the engine and serves it, and with
`--api-server-count N` starts N - 1 more API server processes (`python -m` this module, spec as
JSON on stdin) that bind the same port (SO_REUSEPORT) and attach to the same engine core, which
routes each request's outputs back to its process. One process's GIL carried ~6-10 ms of CPU a
Whisper request: 0.64 of offline under load (RESULTS.md, session 22).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from v1 import envs
from v1.logger import init_logger

logger = init_logger(__name__)

PROGRAM = "v1.entrypoints.openai.api_server_proc"
LISTEN_BACKLOG = 2048
"""uvicorn's own default backlog."""


AUTO_API_SERVERS = 4
"""API server processes of a speech model's server on a GPU when --api-server-count is not
given: a busy Whisper server reached 0.67 of offline with one, 0.91 with 4 and 0.92 with 8
(RESULTS.md, session 22). At most a quarter of the host's CPUs."""


def auto_api_server_count(config: Any, cpu_count: int | None = None) -> int:
    """--api-server-count left unset: AUTO_API_SERVERS for a speech model on a GPU (uploads
    and audio decoding are the per-request work that outgrows one process), else 1."""
    if (
        config.device_config.device_type != "cuda"
        or "transcription" not in config.model_config.info.supported_tasks
    ):
        return 1
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    return max(1, min(AUTO_API_SERVERS, (cpus or 1) // 4))


def use_multiprocess_metrics() -> None:
    """prometheus_client's multiprocess mode for several API server processes: a private
    folder in PROMETHEUS_MULTIPROC_DIR (the other processes inherit it), removed at exit.
    prometheus_client picks its value store when imported (the CLI parser's imports already
    did): it is picked again here, before any metric exists."""
    import atexit
    import shutil
    import tempfile

    from prometheus_client import values

    if envs.prometheus_multiproc_dir() is None:
        folder = tempfile.mkdtemp(prefix="v1-metrics-")
        envs.set_prometheus_multiproc_dir(folder)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    values.ValueClass = values.get_value_class()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed `v1 serve` arguments a child needs (all of them are plain values)."""
    out = {}
    for name, value in vars(args).items():
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(value)
            out[name] = value
    return out


class ApiServerProcesses:
    """The API server processes after the first: started once the engine core is ready, each
    with its frontend's addresses and client index. A child drains on SIGTERM (the first
    process forwards its own; children run in their own session, so a terminal's Ctrl-C
    reaches the first only), exits when the core dies, and exits when the first process is
    gone (its stdin, a pipe only the first process holds, reaches end-of-file)."""

    def __init__(self, args: argparse.Namespace, engine: Any, port: int) -> None:
        client = engine.engine_core
        cores = getattr(client, "cores", None) or [client]  # data parallelism: one per core
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        self._ready_fds: list[int] = []
        """Read ends of the pipes each child writes a byte to once it serves."""
        serve_args = {**_json_args(args), "port": port}
        try:
            for index in range(1, len(cores[0].frontend_addresses) + 1):
                ready_read, ready_write = os.pipe()
                self._ready_fds.append(ready_read)
                spec = {
                    "args": serve_args,
                    "config": engine.config.to_json(),
                    "cores": [[core.pid, *core.frontend_addresses[index - 1]] for core in cores],
                    "client_index": index,
                    "ready_fd": ready_write,
                }
                # Its own session: a terminal's Ctrl-C reaches the first process only, which
                # forwards one SIGTERM (a second signal would cut a child's drain short).
                proc = subprocess.Popen(
                    [sys.executable, "-m", PROGRAM],
                    stdin=subprocess.PIPE,
                    pass_fds=[ready_write],
                    start_new_session=True,
                )
                os.close(ready_write)
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(spec).encode() + b"\n")
                proc.stdin.flush()  # stays open: its end-of-file tells the child we are gone
                self.procs.append(proc)
            self._wait_ready(envs.V1_ENGINE_READY_TIMEOUT_S)
        except BaseException:
            self.stop(timeout=5)
            raise
        logger.info("started %d more API server processes on port %d", len(self.procs), port)

    def _wait_ready(self, timeout_s: float) -> None:
        """Until every child serves (else new connections all reach the first process while
        the others still import and attach)."""
        import select

        waiting = dict(zip(self._ready_fds, self.procs, strict=True))
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], 0.2)
            for fd in ready:
                if not os.read(fd, 1):
                    proc = waiting[fd]
                    proc.wait()
                    raise RuntimeError(
                        f"API server process {proc.pid} exited with code {proc.returncode} "
                        "before it served (see the log above)"
                    )
                del waiting[fd]
            if time.monotonic() > deadline:
                raise TimeoutError(f"API server processes not serving after {timeout_s:.0f} s")

    def exited(self) -> tuple[int, int] | None:
        """(pid, exit code) of a process that exited, or None while all of them run."""
        for proc in self.procs:
            code = proc.poll()
            if code is not None:
                return proc.pid, code
        return None

    def drain(self) -> None:
        """SIGTERM to each (it drains its requests, then exits)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Drains them and waits up to `timeout` s for them to exit, then kills the rest
        (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        self.drain()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.1))
            if proc.poll() is None:
                logger.warning("API server process %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            _forget_metrics(proc.pid)
        for fd in self._ready_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ready_fds = []


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Starts the engine, then serves it with uvicorn on uvloop until SIGINT / SIGTERM (a
    drain, then 0) or the engine's death (1, unless --keep-alive-on-engine-death). Returns the
    process exit code. With --api-server-count N > 1 this process starts the engine core for
    N frontends, binds the port with SO_REUSEPORT (the kernel spreads connections over the
    processes) and starts N - 1 more API server processes (`api_server_proc`) that share both;
    one of them exiting ends the server (code 1)."""
    from v1.config import make_engine_config
    from v1.engine.async_llm import AsyncLLM
    from v1.entrypoints.openai.api_server import check_server_args, serve_engine

    check_server_args(args)
    config = make_engine_config(args.model, **engine_kwargs)
    count = getattr(args, "api_server_count", None)
    if count is None:
        count = auto_api_server_count(config)
    if count == 1:
        return serve_engine(args, AsyncLLM.from_engine_config(config))
    logger.info("%d API server processes", count)
    use_multiprocess_metrics()
    engine = AsyncLLM.from_engine_config(config, extra_frontends=count - 1)
    try:
        sock = reuse_port_socket(args.host, args.port)
        children = ApiServerProcesses(args, engine, port=sock.getsockname()[1])
    except BaseException:
        engine.shutdown()
        raise
    return serve_engine(args, engine, sock=sock, children=children)


def _forget_metrics(pid: int) -> None:
    """Drops an exited process's live gauges (requests in flight) from /metrics."""
    if envs.prometheus_multiproc_dir() is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def _exit_when_parent_gone(stdin_fd: int) -> None:
    """The first process holds our stdin's other end: end-of-file means it is gone."""
    while os.read(stdin_fd, 65536):
        pass
    logger.error("the first API server process is gone; exiting")
    os._exit(1)


def main() -> int:
    """A child API server: reads its spec from stdin, attaches to the core, serves."""
    from v1.config import EngineConfig
    from v1.core.process_handles import AttachedCore
    from v1.engine.async_llm import AsyncLLM
    from v1.entrypoints.openai.api_server import serve_engine

    spec = json.loads(sys.stdin.buffer.readline())
    threading.Thread(
        target=_exit_when_parent_gone, args=(sys.stdin.fileno(),), name="ParentWatch", daemon=True
    ).start()
    args = argparse.Namespace(**spec["args"])
    cores = [AttachedCore(pid, i, o, spec["client_index"]) for pid, i, o in spec["cores"]]
    config = EngineConfig.from_json(spec["config"])
    attach = cores if config.parallel_config.data_parallel_size > 1 else cores[0]
    engine = AsyncLLM.from_engine_config(config, attach=attach)
    sock = reuse_port_socket(args.host, args.port)
    ready_fd = spec["ready_fd"]

    def tell_ready() -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    return serve_engine(args, engine, sock=sock, on_started=tell_ready)


if __name__ == "__main__":
    sys.exit(main())
