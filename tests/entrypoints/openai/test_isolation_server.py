"""Isolation on the OpenAI-compatible server (issue 36): no request harms another.

Two tiny-Llama servers of their own, started together: `iso` (prompts split across prefill
chunks, short body timeout, a small per-client connection cap) and `budget` (a short
--max-request-seconds and --health-timeout, for the frozen-core tests; SIGTERM ends it last).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import RemoteServer, assert_error_body
from tests.utils import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)

CMPL = "/v1/completions"
BODY_TIMEOUT_S = 2
PER_CLIENT = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RemoteServer]]:
    root = tmp_path_factory.mktemp("isolation")
    model = make_tiny_llama_dir(root / "llama", max_position_embeddings=1024)
    common = ["--max-model-len", "1024", "--num-kv-blocks", "400", "--max-num-seqs", "16"]
    started = {
        "iso": RemoteServer(
            "iso",
            model,
            [
                *common,
                "--max-num-batched-tokens",
                "128",
                "--max-request-bytes",
                "12000000",
                "--body-timeout",
                str(BODY_TIMEOUT_S),
                "--max-connections-per-client",
                str(PER_CLIENT),
                "--keep-alive-timeout",
                "30",
            ],
            root,
        ),
        "budget": RemoteServer(
            "budget",
            model,
            [
                *common,
                "--max-request-seconds",
                "3",
                "--health-timeout",
                "1",
                "--shutdown-timeout",
                "1",
            ],
            root,
        ),
    }
    try:
        yield {name: server.wait_ready() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def iso(servers: dict[str, RemoteServer]) -> RemoteServer:
    return servers["iso"]


def _prompt(i: int, length: int = 500) -> list[int]:
    return [(j * 7 + i) % 370 + 5 for j in range(length)]


def _assert_idle(server: RemoteServer) -> None:
    """No request left running and no KV block held (the engine's gauges)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = server.metric("v1_num_requests_running")
        if running == 0 and server.metric("v1_kv_cache_used_blocks") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"still busy: running={running}")


# ---- 1: echo with logprobs over prompts split into prefill chunks ----
def test_echo_logprobs_of_chunked_prompts(iso: RemoteServer) -> None:
    """9 prompts of 500 token ids, each prefilled in 128-token chunks: every prompt token gets
    its logprob (the first none), then the 2 generated ones."""
    with iso.http(timeout=120) as http:
        body = {"prompt": [_prompt(i) for i in range(9)], "echo": True, "logprobs": 1}
        r = http.post(CMPL, json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 9
        for choice in choices:
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == 502
            assert lp["token_logprobs"][0] is None
            assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert http.get("/health").status_code == 200


def test_thirty_concurrent_echo_requests(iso: RemoteServer) -> None:
    def one(i: int) -> httpx.Response:
        with iso.http(timeout=120) as http:
            body = {"prompt": _prompt(i, 300), "echo": True, "logprobs": 1, "max_tokens": 3}
            return http.post(CMPL, json=body)

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(one, range(30)))
    for r in responses:
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 303
    _assert_idle(iso)


# ---- 2: 4xx at the edge for inputs that used to raise deep inside ----
@pytest.mark.parametrize("penalty", [1000.0, -1000.0])
def test_extreme_length_penalty_is_a_400(iso: RemoteServer, penalty: float) -> None:
    body = {
        "prompt": "hi",
        "use_beam_search": True,
        "n": 2,
        "max_tokens": 4,
        "length_penalty": penalty,
    }
    with iso.http(timeout=60) as http:
        error = assert_error_body(http.post(CMPL, json=body), 400)
    assert error["param"] == "length_penalty"


def test_deeply_nested_json_is_a_400(iso: RemoteServer) -> None:
    schema: Any = {"type": "string"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    with iso.http(timeout=60) as http:
        error = assert_error_body(http.post(CMPL, content=json.dumps(body)), 400)
        assert error["code"] == "json_too_deep" and "64" in error["message"]
        nested = "[" * 600 + "1" + "]" * 600
        raw = http.post(CMPL, content='{"prompt": ' + nested + "}")
        assert assert_error_body(raw, 400)["code"] == "json_too_deep"
        # Brackets inside strings are text, not nesting.
        ok = http.post(CMPL, json={"prompt": "[" * 600, "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_false_json_schema_is_a_400(iso: RemoteServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "never", "schema": False}}
    with iso.http(timeout=60) as http:
        r = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "response_format": fmt})
    error = assert_error_body(r, 400)
    assert "false" in error["message"]


# ---- 3: slow clients ----
def _trickle(port: int, stop: threading.Event, out: list[bytes]) -> None:
    """Headers promising 1,000 body bytes, then one byte every 0.5 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        s.settimeout(0.5)
        reply = b""
        while not stop.is_set():
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                try:
                    s.sendall(b" ")
                except OSError:
                    break
                continue
            if not chunk:
                break
            reply += chunk
            head, sep, body = reply.partition(b"\r\n\r\n")
            length = next(
                (
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length:")
                ),
                None,
            )
            if sep and length is not None and len(body) >= length:
                break
        out.append(reply)


def test_slow_bodies_get_408_while_health_answers(iso: RemoteServer) -> None:
    stop = threading.Event()
    replies: list[bytes] = []
    threads = [
        threading.Thread(target=_trickle, args=(iso.port, stop, replies), daemon=True)
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    healthy = 0
    with iso.http(timeout=30) as http:
        while any(t.is_alive() for t in threads) and healthy < 200:
            assert http.get("/health").status_code == 200
            healthy += 1
            time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    stop.set()
    assert healthy >= 2  # /health answered while the slow bodies were held
    assert len(replies) == 4
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"


def test_per_client_connection_cap(iso: RemoteServer) -> None:
    """Connections from one address beyond --max-connections-per-client get 429; the others,
    and new ones once those close, are served."""
    held = [socket.create_connection(("127.0.0.1", iso.port)) for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", iso.port), timeout=10) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = extra.recv(65536)
        assert reply.startswith(b"HTTP/1.1 429"), reply[:200]
        assert b"too_many_connections" in reply
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the closed connections
        if httpx.get(iso.url + "/health", timeout=10).status_code == 200:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ---- 4: the event loop is not held by one request ----
def test_too_many_stop_strings_is_a_400(iso: RemoteServer) -> None:
    stops = [f"s{i:06d}" for i in range(300_000)]  # 3.6 MB of JSON
    with iso.http(timeout=120) as http:
        r = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "stop": stops})
        error = assert_error_body(r, 400)
        assert error["param"] == "stop"
        long_stop = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "stop": "x" * 5000})
        assert_error_body(long_stop, 400)
        ok = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "stop": stops[:128]})
        assert ok.status_code == 200, ok.text


def test_health_answers_while_a_huge_prompt_batch_is_tokenized(iso: RemoteServer) -> None:
    """A batch of 2,000 long text prompts is tokenized off the event loop: /health answers
    while that request is still in flight (it ends in a 400 over the token budget)."""
    outcome: dict[str, Any] = {}

    def huge() -> None:
        with iso.http(timeout=300) as http:
            prompts = ["hello world " * 400] * 2000
            outcome["r"] = http.post(CMPL, json={"prompt": prompts, "max_tokens": 1})

    t = threading.Thread(target=huge)
    answered_during = 0
    with iso.http(timeout=60) as http:
        t.start()
        while t.is_alive():
            assert http.get("/health").status_code == 200
            if t.is_alive():
                answered_during += 1
            time.sleep(0.02)
    t.join()
    assert assert_error_body(outcome["r"], 400)["code"] == "request_too_large"
    assert answered_during >= 1


# ---- 5 + 6: a frozen core: /health 503, the budget ends requests, KV freed ----
def test_frozen_core_fails_health_and_the_budget_ends_requests(
    servers: dict[str, RemoteServer],
) -> None:
    server = servers["budget"]
    core = server.find_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        result: dict[str, Any] = {}

        def pending() -> None:
            with server.http(timeout=60) as http:
                result["r"] = http.post(CMPL, json={"prompt": "hello", "max_tokens": 8})

        t = threading.Thread(target=pending)
        t.start()
        deadline = time.monotonic() + 30
        with server.http(timeout=30) as http:
            while True:
                health = http.get("/health")
                if health.status_code == 503:
                    break
                assert time.monotonic() < deadline, "a frozen core still passed /health"
                time.sleep(0.2)
        error = assert_error_body(health, 503)
        assert error["code"] == "engine_unresponsive"
        assert int(health.headers["Retry-After"]) >= 1
        t.join(timeout=60)
        error = assert_error_body(result["r"], 408)  # --max-request-seconds 3
        assert error["code"] == "request_timeout" and "--max-request-seconds" in error["message"]
    finally:
        os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    _assert_idle(server)  # the timed-out request's KV blocks were freed
    with server.http(timeout=60) as http:
        assert http.post(CMPL, json={"prompt": "hello", "max_tokens": 2}).status_code == 200


# ---- 9: SIGTERM under load (last: it ends the budget server) ----
def test_sigterm_under_load_exits_promptly(servers: dict[str, RemoteServer]) -> None:
    server = servers["budget"]
    stop = threading.Event()

    def load() -> None:
        body = {"prompt": "hello " * 20, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with server.http(timeout=60) as http:
            while not stop.is_set():
                try:
                    http.post(CMPL, json=body)
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=load, daemon=True) for _ in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.metric("v1_num_requests_running") < 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=10)  # drain 1 s (--shutdown-timeout), then stop
    finally:
        stop.set()
    assert code == 0
    log = Path(server.log_path).read_text(errors="replace")
    assert "ignored SHUTDOWN" not in log, log[-3000:]
