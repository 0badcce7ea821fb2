"""A server of its own (tiny Llama with no chat template, --max-pending 2): chat without a
template is a 400, overload is a 503 with Retry-After, and killing the EngineCore under the
server fails the requests in flight and turns /health to 503 within 2 s."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import RemoteServer, assert_error_body

pytestmark = pytest.mark.timeout(300)

LONG = {"prompt": "hello", "max_tokens": 250, "temperature": 0.0, "ignore_eos": True}


def test_chat_without_a_template_is_400(doomed_server: RemoteServer) -> None:
    with doomed_server.http(timeout=30) as http:
        response = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    error = assert_error_body(response, 400)
    assert "chat template" in error["message"] and error["param"] == "messages"


def _half_sent_request(server: RemoteServer) -> socket.socket:
    """A completions request whose body never finishes: it holds a slot while the server
    waits for the rest."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    return sock


def _wait_in_flight(server: RemoteServer, expected: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("v1_http_requests_in_flight") != expected:
        assert time.monotonic() < deadline, "in-flight count never reached the expected value"
        time.sleep(0.05)


def test_overload_is_503_with_retry_after(doomed_server: RemoteServer) -> None:
    held = [_half_sent_request(doomed_server) for _ in range(2)]  # --max-pending 2
    try:
        _wait_in_flight(doomed_server, 2)
        with doomed_server.http(timeout=30) as http:
            response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            health = http.get("/health")
        error = assert_error_body(response, 503)
        assert error["code"] == "overloaded"
        assert int(response.headers["Retry-After"]) >= 1
        assert health.status_code == 200  # only inference routes are bounded
    finally:
        for sock in held:
            sock.close()
    _wait_in_flight(doomed_server, 0)
    with doomed_server.http(timeout=60) as http:
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert doomed_server.metric("v1_http_requests_rejected_total") == 1


def test_killing_the_core_fails_in_flight_requests(doomed_server: RemoteServer) -> None:
    outcome: dict[str, Any] = {}
    heavy = {**LONG, "n": 8, "temperature": 1.0}  # still running when the core is killed

    def plain() -> None:
        with doomed_server.http(timeout=60) as http:
            outcome["plain"] = http.post("/v1/completions", json=heavy)

    def streamed() -> None:
        lines = []
        with (
            doomed_server.http(timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**heavy, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 1:
                    outcome["stream_started"] = time.monotonic()
        outcome["stream"] = lines

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while "stream_started" not in outcome and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "stream_started" in outcome, "the streamed request never started"
    core = doomed_server.find_core_pid()
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    status = 200
    with doomed_server.http(timeout=5) as http:
        while time.monotonic() - killed < 2.0:
            status = http.get("/health").status_code
            if status == 503:
                break
            time.sleep(0.05)
    assert status == 503, "/health did not turn 503 within 2 s of the core's death"
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    error = assert_error_body(outcome["plain"], 503)
    assert error["code"] == "engine_dead"
    assert outcome["plain"].headers.get("retry-after"), "an engine-death 503 names Retry-After"
    assert "Traceback" not in error["message"] and "Error:" not in error["message"]
    events = [line for line in outcome["stream"] if line]
    last = events[-1] if events else ""
    assert '"error"' in last and "engine_dead" in last, events[-3:]
    with doomed_server.http(timeout=30) as http:
        after = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert_error_body(after, 503)
        assert after.headers.get("retry-after")
        assert assert_error_body(http.get("/health"), 503)["code"] == "engine_dead"
        assert http.get("/metrics").status_code == 200
    assert doomed_server.metric("v1_engine_healthy") == 0
    assert httpx.get(doomed_server.url + "/version").status_code == 200
