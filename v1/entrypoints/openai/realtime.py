"""/v1/realtime: OpenAI Realtime API transcription sessions over a WebSocket.

Speaks both dialects of OpenAI's transcription mode: the GA one (`session.update` with
`session.type = "transcription"` and `audio.input.{format, transcription, turn_detection}`,
answered with `session.updated`) and the beta one (`transcription_session.update` with flat
fields, answered with `transcription_session.updated`). Audio, turns and text are the
`v1.engine.realtime.RealtimeSession`'s; this module parses events, checks keys and limits, and
writes OpenAI's server events. A malformed event gets an `error` event; the session goes on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import uuid
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse
from starlette.websockets import WebSocketState

from v1.core.errors import EngineDeadError
from v1.engine.realtime import (
    Cleared,
    Committed,
    RealtimeError,
    RealtimeSession,
    ServerVad,
    SessionConfig,
    SessionEvent,
    SessionLimits,
    SpeechStarted,
    SpeechStopped,
    TranscriptCompleted,
    TranscriptDelta,
    TranscriptFailed,
    check_session_options,
)
from v1.entrypoints.openai.errors import (
    APIError,
    bounded,
    error_response,
    internal_error_message,
)
from v1.entrypoints.openai.serving_engine import ServerSettings
from v1.logger import init_logger

logger = init_logger(__name__)

KEY_SUBPROTOCOL = "openai-insecure-api-key."
"""Browsers cannot set headers on a WebSocket: they send the key as a subprotocol."""
MAX_EVENT_BYTES = 16 << 20
"""Largest client event (an append of ~5 min of 24 kHz audio as base64)."""


@dataclass(frozen=True)
class RealtimeSettings:
    """Server-wide bounds of realtime sessions (`v1 serve` flags)."""

    max_sessions: int = 64
    """Sessions open at once; more are refused (HTTP 503 on the handshake)."""
    idle_timeout_s: float = 300.0
    """A session with no client event for this long is closed."""
    limits: SessionLimits = SessionLimits()
    """Per-session audio buffer bound and hypothesis interval."""


def add_realtime_routes(app: FastAPI, engine: Any, settings: ServerSettings) -> None:
    """`/v1/realtime` (WebSocket) and the demo page at `/` and `/demo`."""
    server = RealtimeServer(
        engine,
        settings,
        RealtimeSettings(
            max_sessions=settings.max_realtime_sessions,
            idle_timeout_s=settings.realtime_idle_timeout,
            limits=SessionLimits(max_buffer_seconds=min(settings.max_audio_seconds, 600.0)),
        ),
    )
    app.add_api_websocket_route("/v1/realtime", server.handle)
    app.state.realtime = server

    async def page() -> HTMLResponse:
        return HTMLResponse(demo_page())

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/demo", page, methods=["GET"], include_in_schema=False)


def demo_page() -> str:
    """The demo page (microphone -> /v1/realtime, file -> /v1/audio/transcriptions)."""
    return (resources.files("v1.entrypoints.openai") / "static" / "index.html").read_text("utf-8")


class RealtimeServer:
    """Accepts transcription sessions on one engine; `handle` serves one WebSocket."""

    def __init__(self, engine: Any, settings: ServerSettings, realtime: RealtimeSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.realtime = realtime
        self.transcriber = engine.transcriber
        self.num_sessions = 0

    async def handle(self, websocket: WebSocket) -> None:
        rejection = self._reject(websocket)
        if rejection is not None:
            await _deny(websocket, rejection)
            return
        self.num_sessions += 1
        try:
            await websocket.accept(subprotocol=_chosen_subprotocol(websocket))
            await _Connection(self, websocket).run()
        finally:
            self.num_sessions -= 1

    def _reject(self, websocket: WebSocket) -> APIError | None:
        key = self.settings.api_key
        if key is not None and not hmac.compare_digest(_given_key(websocket), key.encode()):
            return APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>' or the "
                f"'{KEY_SUBPROTOCOL}<key>' subprotocol",
                code="invalid_api_key",
            )
        intent = websocket.query_params.get("intent")
        if intent not in (None, "transcription"):
            return APIError(
                400,
                f"this server runs transcription sessions only (intent=transcription), got "
                f"intent={intent!r}",
                param="intent",
                code="invalid_value",
            )
        if self.transcriber is None:
            return APIError(
                400,
                f"/v1/realtime needs a Whisper speech model; {self.settings.model_name!r} is not",
                param="model",
                code="wrong_model_kind",
            )
        if self.num_sessions >= self.realtime.max_sessions:
            return APIError(
                503,
                f"the server holds {self.num_sessions} realtime sessions, its limit "
                "(--max-realtime-sessions); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return None


class _Connection:
    """One session: client events in, server events out (through one queue, in order)."""

    def __init__(self, server: RealtimeServer, websocket: WebSocket) -> None:
        self.server = server
        self.websocket = websocket
        self.outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.session = RealtimeSession(
            server.transcriber,
            self._on_session_event,
            SessionConfig(),
            server.realtime.limits,
            session_id=f"sess_{uuid.uuid4().hex[:20]}",
        )

    async def run(self) -> None:
        sender = asyncio.ensure_future(self._send_loop())
        try:
            self._send("session.created", session=self._ga_session())
            self._send("transcription_session.created", session=self._beta_session())
            await self._receive_loop()
        finally:
            await self.session.close()  # aborts every engine request of the session
            self.outbox.put_nowait(None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender, timeout=5)
            sender.cancel()
            if self.websocket.client_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.websocket.close()

    async def _receive_loop(self) -> None:
        timeout = self.server.realtime.idle_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(self.websocket.receive(), timeout)
            except TimeoutError:
                if self.session.busy:  # idle means: nothing sent and nothing to send back
                    continue
                self._error(
                    f"no client event for {timeout:g} s; closing the session", "idle_timeout"
                )
                return
            except WebSocketDisconnect:
                return
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                text = (message.get("bytes") or b"").decode("utf-8", "replace")
            try:
                await self._dispatch(text)
            except EngineDeadError as e:
                self._error(f"the engine is not running: {e}", "engine_dead", "server_error")
                return
            except Exception as e:  # noqa: BLE001 - the client is told before the session ends
                detail = f"realtime session {self.session.session_id}: {type(e).__name__}: {e}"
                self._error(internal_error_message(detail), "internal_error", "server_error")
                return

    # ---- client events ----
    async def _dispatch(self, text: str) -> None:
        if len(text) > MAX_EVENT_BYTES:
            self._error(f"the event is larger than {MAX_EVENT_BYTES} bytes", "event_too_large")
            return
        try:
            event = json.loads(text)
        except ValueError as e:
            self._error(f"the event is not valid JSON: {e}", "invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self._error("an event must be a JSON object with a string 'type'", "invalid_event")
            return
        kind, event_id = event["type"], event.get("event_id")
        event_id = event_id if isinstance(event_id, str) else None
        try:
            if kind in ("session.update", "transcription_session.update"):
                await self._update(event, beta=kind.startswith("transcription_session"))
            elif kind == "input_audio_buffer.append":
                self.session.append(_audio_bytes(event))
            elif kind == "input_audio_buffer.commit":
                self.session.commit()
            elif kind == "input_audio_buffer.clear":
                self.session.clear()
            else:
                raise RealtimeError(
                    f"unknown or unsupported event type {kind!r} (transcription sessions take "
                    "session.update, transcription_session.update, input_audio_buffer.append, "
                    "input_audio_buffer.commit and input_audio_buffer.clear)",
                    "invalid_event_type",
                    "type",
                )
        except RealtimeError as e:
            self._error(str(e), e.code, param=e.param, event_id=event_id)

    async def _update(self, event: dict[str, Any], beta: bool) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            raise RealtimeError("session must be an object", "invalid_value", "session")
        current = self.session.config
        config = _beta_config(session, current) if beta else _ga_config(session, current)
        model = _model_field(session, beta)
        if model is not None and model not in self.server.settings.served_model_names:
            raise RealtimeError(
                f"the model {model!r} is not served here; this server serves "
                f"{list(self.server.settings.served_model_names)}",
                "model_not_found",
                "input_audio_transcription.model" if beta else "audio.input.transcription.model",
            )
        if (config.language, config.prompt) != (current.language, current.prompt):
            await check_session_options(self.server.transcriber, config)
        self.session.update(config)
        if beta:
            self._send("transcription_session.updated", session=self._beta_session())
        else:
            self._send("session.updated", session=self._ga_session())

    # ---- server events ----
    def _on_session_event(self, event: SessionEvent) -> None:
        if isinstance(event, SpeechStarted):
            self._send(
                "input_audio_buffer.speech_started",
                audio_start_ms=event.audio_start_ms,
                item_id=event.item_id,
            )
        elif isinstance(event, SpeechStopped):
            self._send(
                "input_audio_buffer.speech_stopped",
                audio_end_ms=event.audio_end_ms,
                item_id=event.item_id,
            )
        elif isinstance(event, Committed):
            self._send(
                "input_audio_buffer.committed",
                previous_item_id=event.previous_item_id,
                item_id=event.item_id,
            )
        elif isinstance(event, Cleared):
            self._send("input_audio_buffer.cleared")
        elif isinstance(event, TranscriptDelta):
            self._send(
                "conversation.item.input_audio_transcription.delta",
                item_id=event.item_id,
                content_index=0,
                delta=event.delta,
            )
        elif isinstance(event, TranscriptCompleted):
            self._send(
                "conversation.item.input_audio_transcription.completed",
                item_id=event.item_id,
                content_index=0,
                transcript=event.transcript,
                usage={"type": "duration", "seconds": round(event.seconds, 3)},
            )
        elif isinstance(event, TranscriptFailed):
            self._send(
                "conversation.item.input_audio_transcription.failed",
                item_id=event.item_id,
                content_index=0,
                error={
                    "type": "transcription_error",
                    "code": "transcription_failed",
                    "message": bounded(event.message),
                    "param": None,
                },
            )

    def _send(self, kind: str, **fields: Any) -> None:
        self.outbox.put_nowait(
            {"event_id": f"event_{uuid.uuid4().hex[:20]}", "type": kind, **fields}
        )

    def _error(
        self,
        message: str,
        code: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        event_id: str | None = None,
    ) -> None:
        self._send(
            "error",
            error={
                "type": error_type,
                "code": code,
                "message": bounded(message),
                "param": param,
                "event_id": event_id,
            },
        )

    async def _send_loop(self) -> None:
        while True:
            event = await self.outbox.get()
            if event is None:
                return
            try:
                await self.websocket.send_text(json.dumps(event))
            except (WebSocketDisconnect, RuntimeError, OSError):
                return  # the receive loop sees the disconnect and ends the session

    def _ga_session(self) -> dict[str, Any]:
        config = self.session.config
        return {
            "type": "transcription",
            "id": self.session.session_id,
            "object": "realtime.transcription_session",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": config.input_sample_rate},
                    "transcription": self._transcription(config),
                    "turn_detection": _turn_detection(config.turn_detection),
                    "noise_reduction": None,
                }
            },
            "include": [],
        }

    def _beta_session(self) -> dict[str, Any]:
        config = self.session.config
        return {
            "id": self.session.session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": "pcm16",
            "input_audio_sample_rate": config.input_sample_rate,
            "input_audio_transcription": self._transcription(config),
            "turn_detection": _turn_detection(config.turn_detection),
            "input_audio_noise_reduction": None,
            "modalities": ["text"],
            "include": [],
        }

    def _transcription(self, config: SessionConfig) -> dict[str, Any]:
        return {
            "model": self.server.settings.model_name,
            "language": config.language,
            "prompt": config.prompt or "",
        }


# ---- session objects in, SessionConfig out ----
def _ga_config(session: dict[str, Any], current: SessionConfig) -> SessionConfig:
    kind = session.get("type", "transcription")
    if kind != "transcription":
        raise RealtimeError(
            f"session.type must be 'transcription' on this server, got {kind!r}",
            "invalid_value",
            "session.type",
        )
    _reject_unknown(session, {"type", "audio", "include", "id", "object"}, "session")
    if session.get("include"):
        raise RealtimeError("include is not supported (no logprobs)", "invalid_value", "include")
    audio = _object(session.get("audio"), "session.audio")
    audio_input = _object(audio.get("input"), "session.audio.input")
    config = current
    if "format" in audio_input:
        config = replace(config, input_sample_rate=_format_rate(audio_input["format"], "format"))
    if "transcription" in audio_input:
        config = _with_transcription(config, audio_input["transcription"], "transcription")
    if "turn_detection" in audio_input:
        config = replace(config, turn_detection=_turn_detection_of(audio_input["turn_detection"]))
    _no_noise_reduction(audio_input.get("noise_reduction"), "audio.input.noise_reduction")
    return config


def _beta_config(session: dict[str, Any], current: SessionConfig) -> SessionConfig:
    known = {
        "input_audio_format",
        "input_audio_sample_rate",
        "input_audio_transcription",
        "turn_detection",
        "input_audio_noise_reduction",
        "modalities",
        "include",
        "client_secret",
        "id",
        "object",
    }
    _reject_unknown(session, known, "session")
    if session.get("include"):
        raise RealtimeError("include is not supported (no logprobs)", "invalid_value", "include")
    config = current
    if "input_audio_format" in session:
        config = replace(
            config,
            input_sample_rate=_format_rate(session["input_audio_format"], "input_audio_format"),
        )
    rate = session.get("input_audio_sample_rate")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise RealtimeError(
                f"input_audio_sample_rate must be an integer, got {rate!r}",
                "invalid_value",
                "input_audio_sample_rate",
            )
        config = replace(config, input_sample_rate=rate)
    if "input_audio_transcription" in session:
        config = _with_transcription(
            config, session["input_audio_transcription"], "input_audio_transcription"
        )
    if "turn_detection" in session:
        config = replace(config, turn_detection=_turn_detection_of(session["turn_detection"]))
    _no_noise_reduction(session.get("input_audio_noise_reduction"), "input_audio_noise_reduction")
    return config


def _format_rate(value: Any, param: str) -> int:
    """OpenAI's audio formats: 'pcm16' (beta; 24 kHz) or {type: 'audio/pcm', rate}."""
    if value == "pcm16":
        return 24_000
    if isinstance(value, dict) and value.get("type", "audio/pcm") == "audio/pcm":
        rate = value.get("rate", 24_000)
        if isinstance(rate, bool) or not isinstance(rate, int):
            raise RealtimeError(
                f"{param}.rate must be an integer, got {rate!r}", "invalid_value", param
            )
        return rate
    raise RealtimeError(
        f"{param} must be 'pcm16' or {{'type': 'audio/pcm', 'rate': 16000 | 24000}} (PCM16 "
        f"mono little-endian; G.711 is not supported), got {value!r}",
        "invalid_value",
        param,
    )


def _with_transcription(config: SessionConfig, value: Any, param: str) -> SessionConfig:
    if value is None:
        return replace(config, language=None, prompt=None)
    value = _object(value, param)
    _reject_unknown(value, {"model", "language", "prompt"}, param)
    updates: dict[str, Any] = {}
    for name in ("language", "prompt"):
        if name in value:
            item = value[name]
            if item is not None and not isinstance(item, str):
                raise RealtimeError(
                    f"{param}.{name} must be a string, got {item!r}",
                    "invalid_value",
                    f"{param}.{name}",
                )
            updates[name] = item or None
    return replace(config, **updates)


def _model_field(session: dict[str, Any], beta: bool) -> str | None:
    if beta:
        transcription = session.get("input_audio_transcription")
    else:
        transcription = ((session.get("audio") or {}).get("input") or {}).get("transcription")
    model = transcription.get("model") if isinstance(transcription, dict) else None
    if model is not None and not isinstance(model, str):
        raise RealtimeError(f"model must be a string, got {model!r}", "invalid_value", "model")
    return model


def _turn_detection_of(value: Any) -> ServerVad | None:
    if value is None:
        return None
    value = _object(value, "turn_detection")
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise RealtimeError(
            f"turn_detection.type must be 'server_vad' (or turn_detection null for manual "
            f"commits), got {kind!r}",
            "invalid_value",
            "turn_detection.type",
        )
    _reject_unknown(
        value,
        {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response"},
        "turn_detection",
    )
    fields: dict[str, Any] = {}
    for name, kinds in (
        ("threshold", (int, float)),
        ("prefix_padding_ms", (int,)),
        ("silence_duration_ms", (int,)),
    ):
        item = value.get(name)
        if item is None:
            continue
        if isinstance(item, bool) or not isinstance(item, kinds):
            raise RealtimeError(
                f"turn_detection.{name} must be a number, got {item!r}",
                "invalid_value",
                f"turn_detection.{name}",
            )
        fields[name] = item
    return ServerVad(**fields)


def _turn_detection(vad: ServerVad | None) -> dict[str, Any] | None:
    if vad is None:
        return None
    return {
        "type": "server_vad",
        "threshold": vad.threshold,
        "prefix_padding_ms": vad.prefix_padding_ms,
        "silence_duration_ms": vad.silence_duration_ms,
    }


def _no_noise_reduction(value: Any, param: str) -> None:
    if value is not None:
        raise RealtimeError("noise reduction is not supported; send null", "invalid_value", param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object, got {value!r}", "invalid_value", param)
    return value


def _reject_unknown(value: dict[str, Any], known: set[str], param: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise RealtimeError(
            f"{param} has unsupported fields {unknown}; known: {sorted(known)}",
            "unknown_parameter",
            f"{param}.{unknown[0]}",
        )


def _audio_bytes(event: dict[str, Any]) -> bytes:
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise RealtimeError(
            "audio must be a base64 string of PCM16 audio", "invalid_value", "audio"
        )
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RealtimeError(f"audio is not valid base64: {e}", "invalid_value", "audio") from e


# ---- the handshake ----
def _subprotocols(websocket: WebSocket) -> list[str]:
    return [p for p in websocket.scope.get("subprotocols", []) if isinstance(p, str)]


def _given_key(websocket: WebSocket) -> bytes:
    header = websocket.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    for protocol in _subprotocols(websocket):
        if protocol.startswith(KEY_SUBPROTOCOL):
            return protocol[len(KEY_SUBPROTOCOL) :].encode()
    return b""


def _chosen_subprotocol(websocket: WebSocket) -> str | None:
    """A browser that offers subprotocols needs one back: 'realtime', else the first one that
    does not carry the key."""
    offered = _subprotocols(websocket)
    if "realtime" in offered:
        return "realtime"
    plain = [p for p in offered if not p.startswith(KEY_SUBPROTOCOL)]
    return plain[0] if plain else (offered[0] if offered else None)


async def _deny(websocket: WebSocket, error: APIError) -> None:
    """Refuse the handshake with an HTTP error and OpenAI's body (a close where the ASGI server
    cannot send a response)."""
    try:
        await websocket.send_denial_response(error_response(error))
    except RuntimeError:
        await websocket.close(code=1008, reason=error.message[:120])
