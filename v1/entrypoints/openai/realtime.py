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
import contextlib
import hmac
import json
import uuid
from dataclasses import dataclass
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
from v1.entrypoints.openai.realtime_session import (
    audio_bytes,
    beta_session,
    ga_session,
    model_field,
    session_config,
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
            self._send("session.created", session=self._session_object(beta=False))
            self._send("transcription_session.created", session=self._session_object(beta=True))
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
                self.session.append(audio_bytes(event))
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
        config = session_config(session, current, beta)
        model = model_field(session, beta)
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
            self._send("transcription_session.updated", session=self._session_object(beta=True))
        else:
            self._send("session.updated", session=self._session_object(beta=False))

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

    def _session_object(self, beta: bool) -> dict[str, Any]:
        """The session as OpenAI's server events carry it, in the session's dialect."""
        write = beta_session if beta else ga_session
        return write(self.session.session_id, self.session.config, self.server.settings.model_name)


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
