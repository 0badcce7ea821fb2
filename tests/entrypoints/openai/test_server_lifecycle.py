"""How `v1 serve` stops and what its connections may cost: drain on SIGTERM (503 + Retry-After
for new requests, in-flight ones finish, exit 0), exit 1 when the engine dies, socket
directories removed even when the server is SIGKILLed, and the HTTP limits (header size and
count, header-read timeout, idle connections) answered with OpenAI-shaped bodies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import (
    CHAT_TEMPLATE,
    RemoteServer,
    ServerPool,
    make_chat_llama_dir,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_chat_llama_dir(tmp_path_factory.mktemp("llama"), CHAT_TEMPLATE)


def launch(
    llama_dir: str, log_dir: Path, *args: str, env: dict[str, str] | None = None
) -> RemoteServer:
    return RemoteServer("lifecycle", llama_dir, ["--num-kv-blocks", "64", *args], log_dir, env=env)


@pytest.fixture(scope="module")
def servers(
    llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[RemoteServer, Path]]]:
    """One server per test below, each with the flags it tests and its own TMPDIR (for its
    socket directory), all launched at once: a start-up is two single-threaded programs in a
    row (the server's imports, then its core's), so together they use every CPU. Each test
    stops (or kills) its own server; none is shared."""
    flags: dict[str, tuple[str, ...]] = {
        "drain": ("--shutdown-timeout", "120"),
        "shutdown_timeout": ("--shutdown-timeout", "1", "--max-num-seqs", "1"),
        "engine_death": ("--max-num-seqs", "1"),
        "sigkill": (),
    }
    launched: dict[str, tuple[RemoteServer, Path]] = {}
    try:
        for name, args in flags.items():
            root = tmp_path_factory.mktemp(f"lifecycle_{name}")
            private_tmp = Path(tempfile.mkdtemp(dir=root))
            server = launch(llama_dir, root, *args, env={"TMPDIR": str(private_tmp)})
            launched[name] = (server, private_tmp)
        for server, _ in launched.values():
            server.wait_ready()
        yield launched
    finally:
        for server, _ in launched.values():
            server.stop()


def wait_exit(server: RemoteServer, timeout: float = 30) -> int:
    try:
        return server.proc.wait(timeout=timeout)
    finally:
        server.stop()


def stream_lines(server: RemoteServer, body: dict[str, Any], out: dict[str, Any]) -> None:
    """The non-empty lines of a streamed completion (a transport error ends them as a line)."""
    lines: list[str] = []
    try:
        with (
            server.http(timeout=120) as http,
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
        ):
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    out.setdefault("first", time.monotonic())
    except httpx.HTTPError as e:
        lines.append(f"transport error: {type(e).__name__}: {e}")
    out["lines"] = lines or [""]


LONG = {"prompt": "once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


def _wait_first_line(outs: list[dict[str, Any]]) -> None:
    deadline = time.monotonic() + 60
    while not any("first" in o for o in outs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any("first" in o for o in outs), "no stream started"


def test_sigterm_drains_then_exits_zero(servers: dict[str, tuple[RemoteServer, Path]]) -> None:
    """A request in flight (its body still arriving) is served to the end during the drain,
    while new requests (and /health) get 503 with Retry-After; then the server exits 0."""
    server, _ = servers["drain"]
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()
    held = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    held.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[:5]
    )
    deadline = time.monotonic() + 10
    while server.metric("v1_http_requests_in_flight") != 1:
        assert time.monotonic() < deadline, "the held request never counted as in flight"
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with server.http(timeout=10) as http:
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        health = http.get("/health")
    for response in (refused, health):  # the listener stays open during the drain
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        assert int(response.headers["Retry-After"]) >= 1
    assert server.proc.poll() is None  # still draining: the held request is in flight
    held.sendall(body[5:])
    reply = b""
    while b'"finish_reason"' not in reply:
        chunk = held.recv(65536)
        if not chunk:
            break
        reply += chunk
    held.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert wait_exit(server) == 0


def test_shutdown_timeout_fails_the_rest_with_an_error(
    servers: dict[str, tuple[RemoteServer, Path]],
) -> None:
    """Work still running or queued at --shutdown-timeout ends with an error (an error event
    for a started stream, a 503 body for one that never started); the server exits 0."""
    server, _ = servers["shutdown_timeout"]
    # One at a time, 8 x 240 tokens: far more than 1 s of work on any machine.
    outs: list[dict[str, Any]] = [{} for _ in range(8)]
    threads = [threading.Thread(target=stream_lines, args=(server, LONG, o)) for o in outs]
    for t in threads:
        t.start()
    _wait_first_line(outs)
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert wait_exit(server) == 0
    assert time.monotonic() - signalled < 15
    for t in threads:
        t.join(timeout=30)
    cut = [o for o in outs if o["lines"][-1] != "data: [DONE]"]
    assert cut
    for o in cut:
        assert '"error"' in o["lines"][-1], o["lines"][-2:]


def _ipc_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("v1-engine-*"))


def test_engine_death_exits_nonzero_and_removes_the_socket_dir(
    servers: dict[str, tuple[RemoteServer, Path]],
) -> None:
    server, private_tmp = servers["engine_death"]
    assert len(_ipc_dirs(private_tmp)) == 1
    outs: list[dict[str, Any]] = [{} for _ in range(4)]  # queued one behind the other
    threads = [threading.Thread(target=stream_lines, args=(server, LONG, o)) for o in outs]
    for t in threads:
        t.start()
    _wait_first_line(outs)
    os.kill(server.find_core_pid(), signal.SIGKILL)
    assert wait_exit(server, timeout=15) == 1  # so an orchestrator restarts it
    for t in threads:
        t.join(timeout=10)
    last_lines = [(o.get("lines") or [""])[-1] for o in outs]
    assert any("engine_dead" in line for line in last_lines), last_lines  # failed first
    assert _ipc_dirs(private_tmp) == []


def test_sigkilled_server_leaves_no_core_and_no_socket_dir(
    servers: dict[str, tuple[RemoteServer, Path]],
) -> None:
    server, private_tmp = servers["sigkill"]
    core = server.find_core_pid()
    assert len(_ipc_dirs(private_tmp)) == 1
    server.proc.kill()
    server.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_alive(core) or _ipc_dirs(private_tmp)):
        time.sleep(0.1)
    assert not _alive(core), "the EngineCore outlived its SIGKILLed server"
    assert _ipc_dirs(private_tmp) == []
    server.stop()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split(") ", 1)[1][0] != "Z"


def test_pytest_death_takes_its_servers_along(llama_dir: str, tmp_path: Path) -> None:
    """A test process killed outright (SIGKILL, no fixture teardown) leaves no `v1 serve`."""
    script = tmp_path / "victim.py"
    pid_file = tmp_path / "server.pid"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})\n"
        "from pathlib import Path\n"
        "from tests.entrypoints.openai.conftest import RemoteServer\n"
        f"s = RemoteServer('victim', {llama_dir!r}, ['--num-kv-blocks', '64'], "
        f"Path({str(tmp_path)!r}))\n"
        f"Path({str(pid_file)!r}).write_text(str(s.proc.pid))\n"
        "time.sleep(600)\n"
    )
    victim = subprocess.Popen([sys.executable, str(script)], env=os.environ.copy())
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    time.sleep(1.0)
    victim.kill()
    victim.wait()
    deadline = time.monotonic() + 30
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid)


# ---- connection limits (the pooled llama server: --header-timeout 2 --keep-alive-timeout 2) ----


def _raw(server: RemoteServer, payload: bytes, wait: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        with contextlib.suppress(OSError):  # the server may close while we still send
            sock.sendall(payload)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    return b"".join(chunks)


def _error_of(response: bytes, status: int) -> dict[str, Any]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), response[:200]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.uses_servers("llama_server")
def test_http_limits_answer_with_openai_bodies(server_pool: ServerPool) -> None:
    server = server_pool.get("llama_server")
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    big = _raw(server, request + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert "exceed" in _error_of(big, 431)["message"]
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(200))
    assert "header fields" in _error_of(_raw(server, request + many + b"\r\n"), 431)["message"]
    garbage = _raw(server, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert _error_of(garbage, 400)["code"] == "invalid_http_request"
    start = time.monotonic()
    slow = _raw(server, request)  # headers never completed
    assert _error_of(slow, 408)["code"] == "request_timeout"
    assert time.monotonic() - start < 6
    start = time.monotonic()
    assert _raw(server, b"") == b""  # a connection that sends nothing is closed
    assert time.monotonic() - start < 6
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
