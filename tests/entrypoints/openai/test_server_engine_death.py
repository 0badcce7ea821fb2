"""A server of its own (tiny Llama with no chat template, --max-pending 2): chat without a
template is a 400, overload is a 503 with Retry-After, and killing the EngineCore under the
server fails the requests in flight and turns /health to 503 within 2 s."""

from __future__ import annotations

import os
import signal
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


def test_overload_is_503_with_retry_after(doomed_server: RemoteServer) -> None:
    with doomed_server.http(timeout=60) as a, doomed_server.http(timeout=60) as b:
        with (
            a.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as first,
            b.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as second,
        ):
            assert next(first.iter_lines()).startswith("data: ")
            assert next(second.iter_lines()).startswith("data: ")
            with doomed_server.http(timeout=30) as c:
                response = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                health = c.get("/health")
            error = assert_error_body(response, 503)
            assert error["code"] == "overloaded"
            assert int(response.headers["Retry-After"]) >= 1
            assert health.status_code == 200  # only inference routes are bounded
    deadline = time.monotonic() + 10
    while doomed_server.metric("v1_http_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    with doomed_server.http(timeout=60) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert doomed_server.metric("v1_http_requests_rejected_total") == 1


def test_killing_the_core_fails_in_flight_requests(doomed_server: RemoteServer) -> None:
    outcome: dict[str, Any] = {}

    def plain() -> None:
        with doomed_server.http(timeout=60) as http:
            outcome["plain"] = http.post("/v1/completions", json=LONG)

    def streamed() -> None:
        lines = []
        with (
            doomed_server.http(timeout=60) as http,
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r,
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
    last = outcome["stream"][-1] if outcome["stream"] else ""
    assert '"error"' in last and "engine_dead" in last, outcome["stream"][-3:]
    with doomed_server.http(timeout=30) as http:
        after = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert_error_body(after, 503)
        assert assert_error_body(http.get("/health"), 503)["code"] == "engine_dead"
        assert http.get("/metrics").status_code == 200
    assert doomed_server.metric("v1_engine_healthy") == 0
    assert httpx.get(doomed_server.url + "/version").status_code == 200
