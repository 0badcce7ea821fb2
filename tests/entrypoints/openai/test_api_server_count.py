"""`v1 serve --api-server-count N`: N HTTP server processes on one port and one engine core.
Concurrent requests spread over the processes all get their own answers (greedy: the same as
one process gives); /metrics sums every process's counters whichever one answers; SIGTERM
drains every process and exits 0 with none left behind; one process dying ends the server
with code 1; with data parallelism every process routes over every core."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import (
    CHAT_TEMPLATE,
    RemoteServer,
    _children,
    make_chat_llama_dir,
    v1_command,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = [f"story number {i} begins" for i in range(24)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_chat_llama_dir(tmp_path_factory.mktemp("llama"), CHAT_TEMPLATE)


SERVERS: dict[str, list[str]] = {
    "one": [],
    "three": ["--api-server-count", "3"],
    "dp": ["--data-parallel-size", "2", "--api-server-count", "2"],
    "dying": ["--api-server-count", "2"],
    "killed": ["--api-server-count", "3"],
}
"""Each test's server (`one`: the reference, one process); each test but the reference's
users stops or kills its own."""


@pytest.fixture(scope="module")
def servers(
    llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RemoteServer]]:
    """Every server of this module, launched at once: a start-up is mostly single-threaded
    imports and model loads, so side by side they use every CPU."""
    root = tmp_path_factory.mktemp("servers")
    launched: dict[str, RemoteServer] = {}
    try:
        for name, flags in SERVERS.items():
            launched[name] = RemoteServer(name, llama_dir, ["--num-kv-blocks", "128", *flags], root)
        for server in launched.values():
            server.wait_ready()
        yield launched
    finally:
        for server in launched.values():
            server.stop()


def api_servers(server: RemoteServer) -> list[int]:
    """The other API server processes under the first one."""
    out = []
    for pid in _children(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"api_server_proc" in cmdline:
            out.append(pid)
    return out


def complete(server: RemoteServer, prompt: str) -> tuple[int, str]:
    with server.http(timeout=120) as http:
        r = http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def test_three_processes_answer_like_one_then_drain(servers: dict[str, RemoteServer]) -> None:
    one, three = servers["one"], servers["three"]
    children = api_servers(three)
    assert len(children) == 2
    expected = [complete(one, p) for p in PROMPTS]
    assert all(status == 200 for status, _ in expected)
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: complete(three, p), PROMPTS))
    assert got == expected
    # Whichever process answers the scrape, the counters are every process's.
    for _ in range(4):
        assert three.metric('v1_http_requests_total{endpoint="/v1/completions"') == len(PROMPTS)
    three.proc.send_signal(signal.SIGTERM)
    assert three.proc.wait(timeout=60) == 0
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_dying_api_server_process_ends_the_server(servers: dict[str, RemoteServer]) -> None:
    server = servers["dying"]
    (child,) = api_servers(server)
    os.kill(child, signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    assert "API server process" in server.log_tail()


def test_the_first_process_killed_takes_the_others_and_the_core(
    servers: dict[str, RemoteServer],
) -> None:
    """SIGKILL leaves no orphans: the other API server processes see their stdin close, the
    core sees its parent go."""
    server = servers["killed"]
    left = [*api_servers(server), server.find_core_pid()]
    assert len(left) == 3
    server.proc.kill()
    server.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and not _is_zombie(pid) for pid in left):
        assert time.monotonic() < deadline, "a process outlived the killed server"
        time.sleep(0.1)


def test_two_processes_over_two_data_parallel_cores(servers: dict[str, RemoteServer]) -> None:
    """Each API server process routes over every core (its own load count); every core sends
    each process its own outputs."""
    one, both = servers["one"], servers["dp"]
    assert len(api_servers(both)) == 1
    prompts = PROMPTS[:12]
    expected = [complete(one, p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: complete(both, p), prompts))
    assert got == expected
    both.proc.send_signal(signal.SIGTERM)
    assert both.proc.wait(timeout=60) == 0


def test_a_bad_count_is_refused(llama_dir: str) -> None:
    done = subprocess.run(
        [*v1_command(), "serve", llama_dir, "--device", "cpu", "--api-server-count", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "at least 1" in done.stderr, done.stderr


def test_the_default_count(llama_dir: str, tmp_path: Path) -> None:
    """Unset: 4 processes for a speech model on a GPU (at most a quarter of the CPUs), else 1
    (CPU, a text model)."""
    from tests.utils import WHISPER_BASE, make_tiny_whisper_dir
    from v1.config import make_engine_config
    from v1.entrypoints.openai.api_server_proc import auto_api_server_count

    if not WHISPER_BASE.is_dir():
        pytest.skip(f"needs {WHISPER_BASE}")
    whisper = make_tiny_whisper_dir(tmp_path / "whisper")
    gpu = make_engine_config(whisper, device="cuda")
    assert auto_api_server_count(gpu, cpu_count=16) == 4
    assert auto_api_server_count(gpu, cpu_count=8) == 2
    assert auto_api_server_count(gpu, cpu_count=2) == 1
    assert auto_api_server_count(make_engine_config(whisper, device="cpu"), cpu_count=64) == 1
    assert auto_api_server_count(make_engine_config(llama_dir, device="cuda"), cpu_count=64) == 1
    dp = make_engine_config(whisper, device="cuda", data_parallel_size=2)
    assert auto_api_server_count(dp, cpu_count=64) == 4
