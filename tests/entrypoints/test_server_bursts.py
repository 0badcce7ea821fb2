"""The server's auto decode bursts (a GPU server resolves num_scheduler_steps to 8; here the
same config is forced on CPU): a non-streamed /v1/audio/transcriptions or /v1/completions runs
in bursts and returns the text of one token a step; a streamed one (stream=true) gets no
burst, so its deltas still come as each token is decoded."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.utils import (
    ONE_TORCH_THREAD,
    WHISPER_BASE,
    make_tiny_whisper_dir,
    needs_assets,
    with_auto_bursts,
)
from v1.config import EngineConfig, make_engine_config
from v1.engine.async_llm import AsyncLLM

pytestmark = [ONE_TORCH_THREAD, pytest.mark.timeout(300)]

SR = 16_000
# Greedy, one pass: thresholds no window fails, so no fallback samples at temperature > 0.
FORM = {
    "model": "whisper-1",
    "language": "en",
    "temperature": "0",
    "compression_ratio_threshold": "1000000",
    "log_prob_threshold": "-1000000",
}


def wav(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    sf.write(
        buf, (0.1 * rng.standard_normal(int(seconds * SR))).astype(np.float32), SR, format="WAV"
    )
    return buf.getvalue()


async def post_all(
    client: httpx.AsyncClient, uploads: list[bytes], stream: bool
) -> list[httpx.Response]:
    fields = {**FORM, "stream": "true"} if stream else FORM
    return await asyncio.gather(
        *(
            client.post(
                "/v1/audio/transcriptions",
                files={"file": (f"c{i}.wav", data)},
                data=fields,
                timeout=120,
            )
            for i, data in enumerate(uploads)
        )
    )


Send = Callable[[httpx.AsyncClient, bool], Awaitable[list[httpx.Response]]]
"""Posts a test's requests through the client, streamed or not; their responses."""


def serve_per_token_and_auto(
    per_token: EngineConfig, settings: Any, send: Send
) -> dict[str, dict[str, Any]]:
    """`send` run non-streamed, then streamed, through the app over an engine of `per_token`
    (one token a step) and over the same engine with auto bursts of 8 (a GPU server's
    resolution, forced here): per engine name, the responses of each and the decode bursts
    each ran."""
    from v1.entrypoints.openai.api_server import build_app

    assert per_token.scheduler_config.num_scheduler_steps == 1  # CPU: no auto bursts
    auto = with_auto_bursts(per_token)
    results: dict[str, dict[str, Any]] = {}
    for name, config in (("per_token", per_token), ("auto", auto)):
        engine = AsyncLLM.from_engine_config(config)
        try:
            app = build_app(engine, settings)

            async def run(app: Any = app, engine: AsyncLLM = engine) -> dict[str, Any]:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    start = (await engine.get_stats())["num_decode_bursts"]
                    plain = await send(client, False)
                    mid = (await engine.get_stats())["num_decode_bursts"]
                    streamed = await send(client, True)
                    end = (await engine.get_stats())["num_decode_bursts"]
                return dict(plain=plain, streamed=streamed, bursts=(mid - start, end - mid))

            results[name] = asyncio.run(run())
        finally:
            engine.shutdown()
    for name, got in results.items():
        assert all(r.status_code == 200 for r in got["plain"] + got["streamed"]), name
    return results


def streamed_text(response: httpx.Response) -> tuple[str, int]:
    events = [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    *deltas, done = events
    assert done["type"] == "transcript.text.done"
    return done["text"], len(deltas)


@needs_assets(WHISPER_BASE)
def test_non_streamed_transcriptions_burst_streamed_ones_do_not(tmp_path) -> None:
    from v1.entrypoints.openai.serving_engine import ServerSettings

    path = make_tiny_whisper_dir(tmp_path / "whisper")
    per_token = make_engine_config(path, device="cpu", max_model_len=40, num_kv_blocks=2048)
    uploads = [wav(3 + i, seed=i) for i in range(4)]
    settings = ServerSettings(served_model_names=("whisper-1",), model_path=path)
    results = serve_per_token_and_auto(
        per_token, settings, lambda client, stream: post_all(client, uploads, stream)
    )
    texts = {n: [r.json()["text"] for r in got["plain"]] for n, got in results.items()}
    streams = {n: [streamed_text(r) for r in got["streamed"]] for n, got in results.items()}
    assert texts["auto"] == texts["per_token"] and any(t.strip() for t in texts["auto"])
    assert [t for t, _ in streams["auto"]] == texts["auto"]
    assert streams["auto"] == streams["per_token"]  # the same deltas, one per decoded piece
    assert results["auto"]["bursts"][0] > 0  # non-streamed windows ran in bursts
    assert results["auto"]["bursts"][1] == 0  # streamed ones did not
    assert results["per_token"]["bursts"] == (0, 0)


def test_non_streamed_completions_burst_streamed_ones_do_not(tiny_llama_dir: str) -> None:
    """/v1/completions under auto bursts: a non-streamed response (its metrics still read every
    output) runs in bursts and returns the text of one token a step; a streamed one gets one
    token a chunk, as with no bursts at all."""
    from v1.entrypoints.openai.serving_engine import ServerSettings

    per_token = make_engine_config(tiny_llama_dir, device="cpu", num_kv_blocks=512)
    body = {"model": "llama", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = ["The quick brown fox", "Hello world", "To be or not"]
    settings = ServerSettings(served_model_names=("llama",), model_path=tiny_llama_dir)

    async def send(client: httpx.AsyncClient, stream: bool) -> list[httpx.Response]:
        return await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={**body, "prompt": p, "stream": stream},
                    timeout=60,
                )
                for p in prompts
            )
        )

    results = serve_per_token_and_auto(per_token, settings, send)

    def chunks(response: httpx.Response) -> list[str]:
        events = [
            line.removeprefix("data: ")
            for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return [json.loads(e)["choices"][0]["text"] for e in events]

    texts = {
        n: [r.json()["choices"][0]["text"] for r in got["plain"]] for n, got in results.items()
    }
    assert texts["auto"] == texts["per_token"]
    streams = {n: [chunks(r) for r in got["streamed"]] for n, got in results.items()}
    assert ["".join(c) for c in streams["auto"]] == texts["auto"]
    assert streams["auto"] == streams["per_token"]  # the same chunks: no burst merged them
    assert results["auto"]["bursts"][0] > 0 and results["auto"]["bursts"][1] == 0
    assert results["per_token"]["bursts"] == (0, 0)
