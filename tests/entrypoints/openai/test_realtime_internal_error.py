"""A realtime session whose server-side work fails (here: the VAD's onnxruntime cannot be
imported, as on a machine without it) gets an OpenAI-style `error` event with an error id
before its session ends, the failure is logged under that id, and the server keeps serving:
a second session without server VAD still transcribes a manually committed turn (real
whisper-base on a LibriSpeech clip)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import soxr
import websockets

from tests.entrypoints.openai.conftest import AUDIO_DIR, WHISPER_DIR, RemoteServer
from tests.utils import require_asset

pytestmark = pytest.mark.timeout(300)

BROKEN_ONNXRUNTIME = 'raise ImportError("onnxruntime is broken on purpose (test)")\n'


def _append(samples: np.ndarray) -> str:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    return json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )


async def _next(ws: Any, kinds: set[str]) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if event["type"] in kinds:
            return event


def _session_update(turn_detection: dict[str, Any] | None) -> str:
    session = {
        "input_audio_format": "pcm16",
        "input_audio_transcription": {"language": "en"},
        "turn_detection": turn_detection,
    }
    return json.dumps({"type": "transcription_session.update", "session": session})


def test_a_failing_session_is_told_and_the_server_keeps_serving(tmp_path: Path) -> None:
    require_asset(WHISPER_DIR)
    shadow = tmp_path / "shadow" / "onnxruntime"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(BROKEN_ONNXRUNTIME)
    import os

    pythonpath = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    server = RemoteServer(
        "rt-broken-vad",
        str(WHISPER_DIR),
        ["--max-num-seqs", "4"],
        tmp_path,
        env={"PYTHONPATH": pythonpath},
    ).wait_ready()
    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    speech, rate = sf.read(str(AUDIO_DIR / "librispeech" / "test_audio_0.flac"), dtype="float32")
    speech = soxr.resample(speech, rate, 24_000)

    async def failing() -> dict[str, Any]:
        async with websockets.connect(url) as ws:
            await _next(ws, {"transcription_session.created"})
            await ws.send(_session_update({"type": "server_vad", "silence_duration_ms": 500}))
            await _next(ws, {"transcription_session.updated"})
            await ws.send(_append(speech))  # server VAD starts: its onnxruntime import fails
            return await _next(ws, {"error"})

    async def working() -> dict[str, Any]:
        async with websockets.connect(url) as ws:
            await _next(ws, {"transcription_session.created"})
            await ws.send(_session_update(None))
            await _next(ws, {"transcription_session.updated"})
            await ws.send(_append(speech))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            return await _next(
                ws, {"conversation.item.input_audio_transcription.completed", "error"}
            )

    try:
        error = asyncio.run(failing())["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error", error
        found = re.fullmatch(r"internal error \(id: ([0-9a-f]{32})\)", error["message"])
        assert found, error
        log = server.log_tail()
        assert found.group(1) in log and "onnxruntime is broken on purpose" in log
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        completed = asyncio.run(working())
        assert completed["type"] == "conversation.item.input_audio_transcription.completed"
        assert completed["transcript"] == " A man said to the universe, Sir, I exist.", completed
    finally:
        server.stop()
