"""Isolation in the output path, on the app in-process (a bug injected into the frontend's
output processing for one request): that request gets a 500 whose body names an error id and
no exception text, the others and /health are served, and the engine stays up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import assert_error_body
from tests.utils import make_tiny_llama_dir

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from v1.engine.async_llm import AsyncLLM

    model = make_tiny_llama_dir(Path(tmp_path_factory.mktemp("llama")))
    llm = AsyncLLM(model, device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_a_failing_output_ends_only_its_request(
    engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from v1.engine.output_processor import OutputProcessor
    from v1.entrypoints.openai.api_server import build_app
    from v1.entrypoints.openai.serving_engine import ServerSettings

    def broken(self: Any, out: Any) -> Any:
        raise IndexError("list index out of range (injected)")

    monkeypatch.setattr(OutputProcessor, "_prompt_logprobs", broken)
    app = build_app(engine, ServerSettings(served_model_names=("m",), model_path="m"))
    prompt = [5 + i % 300 for i in range(100)]  # two prefill chunks

    async def run() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            echo = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2}
            plain = {"prompt": prompt, "max_tokens": 4}
            responses = await asyncio.gather(
                c.post("/v1/completions", json=echo),
                *[c.post("/v1/completions", json=plain) for _ in range(4)],
            )
            after = await c.post("/v1/completions", json=plain)
            return list(responses), after, await c.get("/health")

    with caplog.at_level(logging.ERROR):
        responses, after, health = asyncio.run(run())
    error = assert_error_body(responses[0], 500)
    assert error["message"].startswith("internal error (id: ")
    assert "IndexError" not in error["message"] and "injected" not in error["message"]
    error_id = error["message"].removeprefix("internal error (id: ").rstrip(")")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and any(r.exc_info and "injected" in str(r.exc_info[1]) for r in logged)
    for r in [*responses[1:], after]:
        assert r.status_code == 200, r.text
    assert health.status_code == 200
    assert not engine.errored
    assert not engine.output_processor.has_unfinished_requests()
