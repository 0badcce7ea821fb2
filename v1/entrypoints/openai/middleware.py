"""The server's pure-ASGI middleware, before any route reads a body: checks the API key, bounds
requests in flight (503), caps body sizes and body-read time while they stream in (413 / 408),
bounds the nesting depth of JSON bodies (400), ends a request past its wall-clock budget
(--max-request-seconds: 408) and counts requests per endpoint and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from v1.engine.async_llm import request_group, request_observer
from v1.entrypoints.openai.errors import RETRY_AFTER_S, APIError, error_body, error_response
from v1.entrypoints.openai.http_limits import check_json_depth, timed_receive
from v1.entrypoints.openai.lifecycle import ServerLifecycle
from v1.entrypoints.openai.metrics import RequestObserver, ServerMetrics
from v1.entrypoints.openai.serving_engine import ServerSettings

INFERENCE_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
    }
)
"""Routes that hold engine work; they count against --max-pending."""
_OTHER_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/v1/models", "/tokenize", "/detokenize"}
)
_PUBLIC_PATHS = frozenset({"/health"})
_PAGE_PATHS = frozenset({"/", "/demo"})
"""The demo page (it asks for the key itself and sends it with each call)."""
_AUDIO_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
_FORM_OVERHEAD_BYTES = 1 << 20
"""Room for the multipart framing and text fields around the audio file."""


class ServerMiddleware:
    """API key, in-flight bound, body size cap and request metrics, before any body is read.

    The body cap is checked against Content-Length first, then counted as the body streams in
    (chunked uploads): past it, reading the body raises a 413 APIError, so nothing past the cap
    is ever buffered.
    """

    def __init__(
        self,
        app: ASGIApp,
        settings: ServerSettings,
        metrics: ServerMetrics,
        lifecycle: ServerLifecycle,
    ) -> None:
        self.app = app
        self.api_key = settings.api_key.encode() if settings.api_key else None
        self.max_pending = settings.max_pending
        self.json_limit = settings.max_request_bytes
        self.audio_limit = settings.max_audio_bytes + _FORM_OVERHEAD_BYTES
        self.body_timeout = settings.body_timeout
        self.max_request_seconds = settings.max_request_seconds
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.in_flight = 0
        lifecycle.in_flight = lambda: self.in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = _endpoint_label(path)
        status: dict[str, int] = {}

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        limit = self.audio_limit if path in _AUDIO_PATHS else self.json_limit
        try:
            rejection = self._reject(scope, path) or _check_declared_size(scope, limit)
            if rejection is not None:
                await error_response(rejection)(scope, receive, send_and_record)
                return
            receive = timed_receive(_size_limited(receive, limit), self.body_timeout)
            if path not in _AUDIO_PATHS and _is_json(scope):
                receive = check_json_depth(receive)
            if path not in INFERENCE_PATHS:
                await self.app(scope, receive, send_and_record)
                return
            self.in_flight += 1
            self.metrics.in_flight.set(self.in_flight)
            arrival = time.perf_counter()
            # Every sequence this HTTP request makes shares one fair-share group in the core.
            group = request_group.set(f"http-{uuid.uuid4().hex}")
            observer = request_observer.set(RequestObserver(self.metrics, endpoint))
            try:
                await self._run_budgeted(scope, receive, send_and_record, status)
            except Exception:
                status.setdefault("code", 500)
                raise
            finally:
                request_observer.reset(observer)
                request_group.reset(group)
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)
                self._observe_end(endpoint, status.get("code", 499), arrival)
        except Exception:
            status.setdefault("code", 500)  # answered by the outer ServerErrorMiddleware
            raise
        finally:
            # No response started: the client went away first (nginx's 499).
            self.metrics.observe_request(endpoint, status.get("code", 499))

    async def _run_budgeted(
        self, scope: Scope, receive: Receive, send: Send, status: dict[str, int]
    ) -> None:
        """The app under --max-request-seconds: past it the handler is cancelled (its engine
        requests are aborted, their KV freed) and the client gets a 408 error body, or an error
        event ending a stream that already started."""
        budget = self.max_request_seconds
        if budget is None:
            await self.app(scope, receive, send)
            return
        try:
            await asyncio.wait_for(self.app(scope, receive, send), budget)
        except TimeoutError:
            error = APIError(
                408,
                f"the request ran past this server's limit of {budget:g} s per request "
                "(--max-request-seconds); its work was stopped",
                code="request_timeout",
            )
            if "code" not in status:
                await error_response(error)(scope, receive, send)
                return
            event = json.dumps(error_body(error.message, error.error_type, None, error.code))
            with contextlib.suppress(Exception):  # the client may be gone
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode()})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _observe_end(self, endpoint: str, code: int, arrival: float) -> None:
        """Latency of every inference request; a request that ended without its answer
        (client gone: 499; server error: 5xx) counts as one abort or error. Finishes of
        answered requests are counted where their sequences end (serving_*)."""
        if code < 400 or code == 499:
            self.metrics.observe_e2e(endpoint, time.perf_counter() - arrival)
        if code == 499:
            self.metrics.observe_finish(endpoint, "abort")
        elif code >= 500:
            self.metrics.observe_finish(endpoint, "error")

    def _reject(self, scope: Scope, path: str) -> APIError | None:
        if self.lifecycle.draining and (path in INFERENCE_PATHS or path in _PUBLIC_PATHS):
            return APIError(
                503,
                "the server is shutting down; retry on another instance",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if self.api_key is not None and path not in _PUBLIC_PATHS and path not in _PAGE_PATHS:
            given = _bearer_token(scope)
            if given is None or not hmac.compare_digest(given, self.api_key):
                return APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if path in INFERENCE_PATHS and self.in_flight >= self.max_pending:
            self.metrics.rejected.inc()
            return APIError(
                503,
                f"the server is busy ({self.in_flight} requests in flight, the limit is "
                f"{self.max_pending}); retry later",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return None


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this route's limit of {limit} bytes (audio uploads: "
        "--max-audio-bytes plus 1 MiB for the form; JSON bodies: --max-request-bytes)",
        code="payload_too_large",
    )


def _check_declared_size(scope: Scope, limit: int) -> APIError | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return APIError(400, "invalid Content-Length header")
            return _too_large(limit) if declared > limit else None
    return None


def _size_limited(receive: Receive, limit: int) -> Receive:
    received = 0

    async def receive_counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)
        return message

    return receive_counted


def _is_json(scope: Scope) -> bool:
    if scope.get("method") != "POST":
        return False
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            return not value.lower().startswith(b"multipart/")
    return True  # FastAPI parses a body without a content type as JSON


def _bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


_ALIASES = {"/v2/rerank": "/v1/rerank", "/rerank": "/v1/rerank", "/score": "/v1/score"}
"""Routes counted in the metrics under the name of the route they alias."""


def _endpoint_label(path: str) -> str:
    if path in _ALIASES:
        return _ALIASES[path]
    if path in INFERENCE_PATHS or path in _OTHER_PATHS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"
