"""benchmarks/realtime_latency.py's session client decides when a session is done from the
server's events, not from the clock (issue 38: a completion that arrived while the trailing
silence was still being streamed left the client waiting until the server's idle timeout).

The server here is a scripted WebSocket peer speaking the Realtime transcription events the way
`/v1/realtime` orders them, answering at once, so the timing is deterministic; the real server's
sessions are tested in tests/entrypoints/openai/test_realtime.py."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from tests.utils import ASSETS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not (ASSETS / "audio" / "librispeech" / "test_audio_1.flac").is_file(),
        reason="needs the LibriSpeech clips in ../shared/assets",
    ),
]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("realtime_latency")
    finally:
        sys.path.remove(str(BENCHMARKS))


class ScriptedServer:
    """Answers each transcription_session.update with transcription_session.updated; the
    `turn_at`-th append starts a turn, the `stop_at`-th ends it (speech_stopped, committed and,
    at once, its `outcome`: completed or failed); a commit ends an open turn the same way."""

    def __init__(self, turn_at: int, stop_at: int | None, outcome: str = "completed") -> None:
        self.turn_at, self.stop_at, self.outcome = turn_at, stop_at, outcome
        self.received: list[str] = []

    async def handle(self, ws: ServerConnection) -> None:
        appends, item, ms = 0, None, 0

        async def send(kind: str, **fields: Any) -> None:
            await ws.send(json.dumps({"type": kind, **fields}))

        async def finish(item: str) -> None:
            await send("input_audio_buffer.committed", item_id=item, previous_item_id=None)
            if self.outcome == "completed":
                await send(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item,
                    content_index=0,
                    delta=" hello",
                )
                await send(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=item,
                    content_index=0,
                    transcript=" hello",
                )
            else:
                await send(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item,
                    content_index=0,
                    error={"type": "transcription_error", "message": "boom"},
                )

        await send("transcription_session.created", session={})
        async for message in ws:
            event = json.loads(message)
            self.received.append(event["type"])
            if event["type"] == "transcription_session.update":
                await send("transcription_session.updated", session=event["session"])
            elif event["type"] == "input_audio_buffer.append":
                appends += 1
                ms += 100
                if appends == self.turn_at:
                    item = "item_1"
                    await send("input_audio_buffer.speech_started", item_id=item, audio_start_ms=0)
                elif appends == self.stop_at and item is not None:
                    await send("input_audio_buffer.speech_stopped", item_id=item, audio_end_ms=ms)
                    await finish(item)
                    item = None
            elif event["type"] == "input_audio_buffer.commit" and item is not None:
                await finish(item)
                item = None


def _args(**overrides: Any) -> argparse.Namespace:
    values = dict(
        api_key=None, language="en", silence_ms=500, speed=20.0, gap=6.0, phrases=1, timeout=20.0
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def _run(bench: ModuleType, server: ScriptedServer, args: argparse.Namespace) -> Any:
    async def main() -> Any:
        async with serve(server.handle, "127.0.0.1", 0) as ws_server:
            port = next(iter(ws_server.sockets)).getsockname()[1]
            pcm, spans = bench._stream(args.phrases, args.gap)
            return await bench.run_session(f"ws://127.0.0.1:{port}", args, pcm, spans)

    return asyncio.run(main())


def test_completion_before_the_audio_ends_finishes_the_session(bench: ModuleType) -> None:
    # The phrase (LibriSpeech clip 0, ~4 s after 0.5 s of silence) is completed at the 50th
    # append, while ~6 s of trailing silence are still to be streamed.
    server = ScriptedServer(turn_at=8, stop_at=50)
    result = _run(bench, server, _args())
    assert result.errors == []
    (phrase,) = result.phrases
    assert phrase.transcript == " hello"
    assert phrase.completed is not None and phrase.first_delta is not None
    # Every append went out, then the barrier update, and nothing else was needed.
    assert server.received[-1] == "transcription_session.update"
    assert "input_audio_buffer.commit" not in server.received


def test_turn_still_open_at_the_end_is_committed(bench: ModuleType) -> None:
    server = ScriptedServer(turn_at=8, stop_at=None)
    result = _run(bench, server, _args(gap=0.2))
    assert result.errors == []
    assert result.phrases[0].transcript == " hello"
    assert server.received[-1] == "input_audio_buffer.commit"


def test_failed_turn_is_an_error_not_a_hang(bench: ModuleType) -> None:
    server = ScriptedServer(turn_at=8, stop_at=50, outcome="failed")
    result = _run(bench, server, _args())
    assert result.errors == ["turn item_1 failed: boom"]
    assert result.phrases[0].completed is None


def test_server_that_closes_early_is_reported(bench: ModuleType) -> None:
    class Closing(ScriptedServer):
        async def handle(self, ws: ServerConnection) -> None:
            await ws.recv()
            await ws.close()

    result = _run(bench, Closing(0, None), _args(gap=0.2))
    assert "the server closed the session before every turn completed" in result.errors
