"""/v1/realtime transcription sessions with the real whisper-base: the official openai client
(GA events, 16 kHz, manual commit), server VAD at 24 kHz with deltas while a turn is spoken (the
beta events, as the demo page's flow), completed text equal to the engine's transcription of the
same audio, malformed events, API keys, the session limit, the idle timeout and a client that
leaves mid-turn (every KV block freed)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
import websockets

from tests.entrypoints.openai.conftest import API_KEY, AUDIO_DIR, WHISPER_DIR, RemoteServer
from tests.utils import require_asset

pytestmark = pytest.mark.timeout(300)

CLIP_0 = AUDIO_DIR / "librispeech" / "test_audio_0.flac"
CLIP_1 = AUDIO_DIR / "librispeech" / "test_audio_1.flac"
TEXT_0 = " A man said to the universe, Sir, I exist."
TEXT_1 = " Nor is Mr. Quilter's manner less interesting than his matter."
MAX_SESSIONS = 2
IDLE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    require_asset(WHISPER_DIR)
    args = [
        "--served-model-name",
        "whisper-1",
        "--api-key",
        API_KEY,
        "--max-realtime-sessions",
        str(MAX_SESSIONS),
        "--realtime-idle-timeout",
        str(IDLE_TIMEOUT_S),
        "--max-num-seqs",
        "16",
    ]
    remote = RemoteServer("realtime", str(WHISPER_DIR), args, tmp_path_factory.mktemp("rt"))
    try:
        yield remote.wait_ready()
    finally:
        remote.stop()


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _clip(path: Any, rate: int) -> np.ndarray:
    samples, source_rate = sf.read(str(path), dtype="float32")
    assert source_rate == 16_000
    return samples if rate == 16_000 else soxr.resample(samples, 16_000, rate, quality="HQ")


def _wav(samples: np.ndarray, rate: int = 16_000, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z ]", " ", text.lower().replace("'", "")).split())


def _ws_url(server: RemoteServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"


def _append(pcm: bytes) -> str:
    return json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )


async def _transcribe_http(server: RemoteServer, wav: bytes, language: str = "en") -> str:
    client = server.async_openai()
    result = await client.audio.transcriptions.create(
        model="whisper-1", file=("turn.wav", wav), language=language
    )
    return result.text


async def _recv(ws: Any, timeout: float = 120) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def _until(ws: Any, kind: str, seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    while True:
        event = await _recv(ws)
        if seen is not None:
            seen.append(event)
        if event["type"] == kind:
            return event
        assert event["type"] != "error", event


# ---- the official client, GA events, manual commit ----
def test_openai_client_manual_commit_16k(server: RemoteServer) -> None:
    """The official client's realtime interface, unchanged: 16 kHz PCM16, turn_detection null,
    one commit; the completed transcript is the engine's transcription of those samples."""
    samples = _clip(CLIP_0, 16_000)
    pcm = _pcm16(samples)

    async def run() -> tuple[list[Any], str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        events: list[Any] = []
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await conn.session.update(
                session={
                    "type": "transcription",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 16000},
                            "turn_detection": None,
                            "transcription": {"model": "whisper-1", "language": "en"},
                        }
                    },
                }
            )
            for start in range(0, len(pcm), 3200):  # 100 ms appends
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[start : start + 3200]).decode()
                )
            await conn.input_audio_buffer.commit()
            async for event in conn:
                events.append(event)
                assert event.type != "error", event
                if event.type == "conversation.item.input_audio_transcription.completed":
                    break
        # The same samples (PCM16 / 32768) through /v1/audio/transcriptions.
        same = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        return events, await _transcribe_http(server, _wav(same))

    events, http_text = asyncio.run(run())
    types = [e.type for e in events]
    assert types[:3] == ["session.created", "transcription_session.created", "session.updated"]
    assert events[2].session.audio.input.format.rate == 16000
    assert events[2].session.audio.input.turn_detection is None
    committed = events[types.index("input_audio_buffer.committed")]
    completed = events[-1]
    assert completed.item_id == committed.item_id
    assert completed.transcript == http_text == TEXT_0
    assert completed.usage.type == "duration"
    assert completed.usage.seconds == pytest.approx(len(samples) / 16_000, abs=1e-3)
    deltas = [e.delta for e in events if e.type.endswith("transcription.delta")]
    assert "".join(deltas) == completed.transcript


# ---- server VAD, 24 kHz, the beta events: the demo page's flow ----
def test_server_vad_24k_two_turns_with_deltas(server: RemoteServer) -> None:
    """Two utterances with silence between them, streamed at 24 kHz under server VAD, as the
    demo page sends them (key as subprotocol): two turns, committed in order; deltas of the
    turn come before its completion; each completed transcript equals the engine's
    transcription of the turn's audio (audio_start_ms..audio_end_ms of the same stream)."""
    rate = 24_000
    silence = np.zeros(int(1.5 * rate), np.float32)
    stream = np.concatenate([silence[: rate // 2], _clip(CLIP_0, rate), silence])
    stream = np.concatenate([stream, _clip(CLIP_1, rate), silence])
    pcm = _pcm16(stream)
    block = rate // 5 * 2  # 200 ms

    async def run() -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        protocols = ["realtime", f"openai-insecure-api-key.{API_KEY}"]
        async with websockets.connect(_ws_url(server), subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime"
            await _until(ws, "transcription_session.created")
            await ws.send(
                json.dumps(
                    {
                        "type": "transcription_session.update",
                        "session": {
                            "input_audio_format": "pcm16",
                            "input_audio_transcription": {"model": "whisper-1", "language": "en"},
                            "turn_detection": {
                                "type": "server_vad",
                                "threshold": 0.5,
                                "prefix_padding_ms": 300,
                                "silence_duration_ms": 700,
                            },
                        },
                    }
                )
            )
            updated = await _until(ws, "transcription_session.updated")
            assert updated["session"]["turn_detection"]["silence_duration_ms"] == 700

            async def feed() -> None:
                for start in range(0, len(pcm), block):
                    await ws.send(_append(pcm[start : start + block]))
                    await asyncio.sleep(0.4)  # slower than real time: hypotheses keep up

            feeder = asyncio.ensure_future(feed())
            completed = 0
            while completed < 2:
                event = await _recv(ws)
                seen.append(event)
                assert event["type"] != "error", event
                completed += event["type"].endswith("transcription.completed")
            await feeder
        return seen

    seen = asyncio.run(run())
    types = [e["type"] for e in seen]
    starts = [e for e in seen if e["type"] == "input_audio_buffer.speech_started"]
    stops = [e for e in seen if e["type"] == "input_audio_buffer.speech_stopped"]
    committed = [e for e in seen if e["type"] == "input_audio_buffer.committed"]
    done = [e for e in seen if e["type"].endswith("transcription.completed")]
    assert len(starts) == len(stops) == len(committed) == 2, types
    assert [e["item_id"] for e in done] == [e["item_id"] for e in committed]
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    for turn in done:
        # Deltas of a turn come before its completion and add up to its transcript (those
        # sent while the turn is spoken are the engine-level tests' subject: their timing
        # depends on the machine's speed).
        assert all(
            seen.index(e) < seen.index(turn)
            for e in seen
            if e["type"].endswith("delta") and e["item_id"] == turn["item_id"]
        )
        deltas = [
            e["delta"]
            for e in seen
            if e["type"].endswith("delta") and e["item_id"] == turn["item_id"]
        ]
        assert "".join(deltas) == turn["transcript"]
    # The turns' audio as the server resampled it (soxr HQ, streamed = whole), cut at the
    # reported milliseconds, through /v1/audio/transcriptions.
    at_16k = soxr.resample(
        np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0, rate, 16_000, quality="HQ"
    )
    cuts = [
        at_16k[s["audio_start_ms"] * 16 : e["audio_end_ms"] * 16]
        for s, e in zip(starts, stops, strict=True)
    ]
    http = asyncio.run(_gather_http(server, cuts))
    assert [t["transcript"] for t in done] == http
    assert _words(done[0]["transcript"]) == _words(TEXT_0)
    assert _words(done[1]["transcript"]) == _words(TEXT_1)


async def _gather_http(server: RemoteServer, cuts: list[np.ndarray]) -> list[str]:
    return list(await asyncio.gather(*(_transcribe_http(server, _wav(c)) for c in cuts)))


# ---- faults ----
def test_malformed_events_get_error_events_and_the_session_goes_on(server: RemoteServer) -> None:
    bad_events = [
        ("not json", "invalid_json", None),
        (json.dumps([1, 2]), "invalid_event", None),
        (json.dumps({"type": "response.create", "event_id": "e1"}), "invalid_event_type", "type"),
        (
            json.dumps({"type": "input_audio_buffer.append", "audio": "%%%", "event_id": "e2"}),
            "invalid_value",
            "audio",
        ),
        (json.dumps({"type": "input_audio_buffer.append", "audio": 5}), "invalid_value", "audio"),
        (
            json.dumps({"type": "input_audio_buffer.commit"}),
            "input_audio_buffer_commit_empty",
            None,
        ),
        (
            json.dumps({"type": "session.update", "session": {"type": "realtime"}}),
            "invalid_value",
            "session.type",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"input_audio_format": "g711_ulaw"},
                }
            ),
            "invalid_value",
            "input_audio_format",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"input_audio_sample_rate": 44100},
                }
            ),
            "invalid_value",
            "input_audio_format",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"turn_detection": {"type": "semantic_vad"}},
                }
            ),
            "invalid_value",
            "turn_detection.type",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"turn_detection": {"type": "server_vad", "threshold": 2}},
                }
            ),
            "invalid_value",
            "turn_detection.threshold",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"input_audio_transcription": {"language": "xx-nope"}},
                }
            ),
            "invalid_value",
            "language",
        ),
        (
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"input_audio_transcription": {"model": "gpt-4o-transcribe"}},
                }
            ),
            "model_not_found",
            "input_audio_transcription.model",
        ),
        (
            json.dumps({"type": "transcription_session.update", "session": {"voice": "alloy"}}),
            "unknown_parameter",
            "session.voice",
        ),
    ]

    async def run() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            await _until(ws, "transcription_session.created")
            for text, code, param in bad_events:
                await ws.send(text)
                event = await _recv(ws)
                assert event["type"] == "error", (text, event)
                error = event["error"]
                assert (error["code"], error["param"]) == (code, param), (text, error)
                assert error["type"] == "invalid_request_error" and error["message"]
                if '"event_id"' in text:
                    assert error["event_id"] == json.loads(text)["event_id"]
            # Still alive and unchanged by the rejected updates: a clear, then a valid update.
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert (await _recv(ws))["type"] == "input_audio_buffer.cleared"
            await ws.send(
                json.dumps(
                    {"type": "transcription_session.update", "session": {"turn_detection": None}}
                )
            )
            updated = await _recv(ws)
            assert updated["type"] == "transcription_session.updated"
            assert updated["session"]["input_audio_sample_rate"] == 24000
            assert updated["session"]["turn_detection"] is None
            assert updated["session"]["input_audio_transcription"]["language"] is None

    asyncio.run(run())


def test_api_key_session_limit_and_idle_timeout(server: RemoteServer) -> None:
    async def run() -> None:
        url = _ws_url(server)
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(url):
                pass
        assert info.value.response.status_code == 401
        assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(url, subprotocols=["openai-insecure-api-key.wrong"]):
                pass
        assert info.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(
                url.replace("intent=transcription", "intent=conversation"),
                additional_headers={"Authorization": f"Bearer {API_KEY}"},
            ):
                pass
        assert info.value.response.status_code == 400

        headers = {"Authorization": f"Bearer {API_KEY}"}
        sessions = [
            await websockets.connect(url, additional_headers=headers) for _ in range(MAX_SESSIONS)
        ]
        for ws in sessions:
            assert (await _recv(ws))["type"] == "session.created"
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(url, additional_headers=headers):
                pass
        assert info.value.response.status_code == 503
        assert json.loads(info.value.response.body)["error"]["code"] == "overloaded"
        # Sessions that send nothing are closed after the idle timeout, with an error event.
        for ws in sessions:
            events = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    events.append(await _recv(ws, timeout=IDLE_TIMEOUT_S + 30))
            assert events[-1]["type"] == "error"
            assert events[-1]["error"]["code"] == "idle_timeout"
        # Their slots are free again.
        async with websockets.connect(url, additional_headers=headers) as ws:
            assert (await _recv(ws))["type"] == "session.created"

    asyncio.run(run())


def test_client_that_leaves_mid_turn_frees_every_kv_block(server: RemoteServer) -> None:
    """A client commits a long turn and disconnects while it is transcribed: its requests are
    aborted and the KV cache empties; the engine goes on serving."""
    samples, rate = sf.read(str(AUDIO_DIR / "jfk.flac"), dtype="float32")
    samples = soxr.resample(samples.mean(axis=1) if samples.ndim > 1 else samples, rate, 16_000)
    pcm = _pcm16(np.concatenate([samples, samples]))  # 22 s: several windows' worth of work

    def used_blocks() -> float:
        return server.metric("v1_kv_cache_used_blocks")

    async def run() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "transcription",
                            "audio": {
                                "input": {
                                    "format": {"type": "audio/pcm", "rate": 16000},
                                    "turn_detection": None,
                                    "transcription": {"language": "en"},
                                }
                            },
                        },
                    }
                )
            )
            for start in range(0, len(pcm), 64_000):
                await ws.send(_append(pcm[start : start + 64_000]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await _until(ws, "input_audio_buffer.committed")
            deadline = time.monotonic() + 120
            while used_blocks() == 0:  # the turn's requests hold blocks
                assert time.monotonic() < deadline, "the turn never reached the engine"
                await asyncio.sleep(0.05)
        # Disconnected mid-turn.

    asyncio.run(run())
    deadline = time.monotonic() + 60
    while used_blocks() != 0:
        assert time.monotonic() < deadline, f"{used_blocks()} KV blocks still in use"
        time.sleep(0.2)
    assert asyncio.run(_transcribe_http(server, _wav(_clip(CLIP_0, 16_000)))) == TEXT_0


def test_demo_page_is_served_without_a_key(server: RemoteServer) -> None:
    """The page itself (its script then sends the key it is given)."""
    for path in ("/", "/demo"):
        response = httpx.get(server.url + path, timeout=30)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        page = response.text
        for needle in (
            "/v1/realtime?intent=transcription",
            "openai-insecure-api-key.",
            "input_audio_buffer.append",
            "/v1/audio/transcriptions",
            'id="transcript"',
            "AudioWorkletProcessor",
        ):
            assert needle in page, needle
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


# ---- the demo page in a real browser ----
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _DevTools:
    """The DevTools protocol of one page, over its WebSocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    async def text(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


async def _page_websocket(user_data: Any, deadline: float) -> str:
    port_file = user_data / "DevToolsActivePort"
    while not port_file.exists():
        assert time.monotonic() < deadline, "chromium did not start"
        await asyncio.sleep(0.2)
    port = port_file.read_text().split()[0]
    while True:
        targets = httpx.get(f"http://127.0.0.1:{port}/json", timeout=10).json()
        pages = [t for t in targets if t["type"] == "page" and "127.0.0.1" in t["url"]]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        assert time.monotonic() < deadline, targets
        await asyncio.sleep(0.2)


@pytest.mark.timeout(600)
def test_demo_page_in_headless_chromium(server: RemoteServer, tmp_path: Any) -> None:
    """Chromium plays a speech file as its microphone into the demo page, which streams it to
    /v1/realtime; the page shows the transcript. Then the page uploads the same file to
    /v1/audio/transcriptions. A screenshot of the page is kept (path printed)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    speech = _clip(CLIP_0, 16_000)
    silence = np.zeros(16_000 * 30, np.float32)
    microphone = tmp_path / "microphone.wav"  # Chromium loops it: speech, then 30 s silence
    microphone.write_bytes(
        _wav(np.concatenate([silence[:8000], speech, silence]), subtype="PCM_16")
    )
    user_data = tmp_path / "chromium-profile"
    url = f"{server.url}/?autostart=1&language=en&key={API_KEY}"
    proc = subprocess.Popen(
        [
            browser,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={microphone}",
            "--autoplay-policy=no-user-gesture-required",
            "--remote-debugging-port=0",
            f"--user-data-dir={user_data}",
            "--window-size=1100,800",
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def run() -> tuple[list[str], str, bytes]:
        deadline = time.monotonic() + 540
        async with websockets.connect(
            await _page_websocket(user_data, deadline), max_size=None
        ) as ws:
            page = _DevTools(ws)
            finals: list[str] = []
            # Server VAD may cut the utterance at its pause: the turns, in order, hold it.
            while not _words(" ".join(finals)).startswith(_words(TEXT_0)):
                assert time.monotonic() < deadline, await page.text("document.body.innerText")
                await asyncio.sleep(0.5)
                finals = await page.text(
                    "[...document.querySelectorAll('.turn.final')].map(e => e.textContent)"
                )
            document = await page.call("DOM.getDocument")
            node = await page.call(
                "DOM.querySelector", nodeId=document["root"]["nodeId"], selector="#file"
            )
            await page.call("DOM.setFileInputFiles", files=[str(CLIP_0)], nodeId=node["nodeId"])
            await page.text("document.getElementById('upload').click()")
            uploaded = ""
            while not uploaded:
                assert time.monotonic() < deadline, await page.text("document.body.innerText")
                await asyncio.sleep(0.5)
                uploaded = await page.text("document.getElementById('file-result').textContent")
            shot = await page.call("Page.captureScreenshot", format="png")
            return finals, uploaded, base64.b64decode(shot["data"])

    try:
        finals, uploaded, png = asyncio.run(run())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    screenshot = tmp_path / "demo_page.png"
    screenshot.write_bytes(png)
    print(f"demo page screenshot: {screenshot}")
    assert _words(" ".join(finals)).startswith(_words(TEXT_0))
    assert uploaded == TEXT_0
