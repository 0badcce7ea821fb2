"""HTTP connection limits the ASGI app cannot enforce (it sees a request only once its headers
are in): header size and count, a header-read timeout, an idle timeout for connections that send
nothing, a cap on open connections and one per client address (slow clients from one address
cannot take every connection). A uvicorn httptools protocol subclass; the answers it sends itself
(431, 408, 429, 503, 400 for unparseable requests) carry the OpenAI error body too.

Limits on the body, applied by the app's middleware as it reads the body: a body-read timeout
(`timed_receive`, 408), the nesting depth of JSON bodies (`check_json_depth`, 400), and
`read_upload_bounded` for multipart uploads.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httptools
import numpy as np
from starlette.datastructures import UploadFile
from starlette.types import Message, Receive
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from v1.entrypoints.openai.errors import APIError, error_body
from v1.logger import init_logger

logger = init_logger(__name__)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_REASONS[503] = b"Service Unavailable"
_REASONS[429] = b"Too Many Requests"
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects in a JSON request body (schemas included); deeper is a
400 (parsing and walking a deeper document recurses past Python's stack)."""


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits (`v1 serve` flags of the same names)."""

    max_header_bytes: int = 64 << 10
    """Request line plus all header names and values, in bytes; more gets 431."""
    max_headers: int = 128
    """Header fields per request; more gets 431."""
    header_timeout: float = 10.0
    """Seconds from a request's first byte until its headers are complete; then 408."""
    max_connections: int = 1000
    """Open connections; a new one beyond it gets 503 with Retry-After and is closed."""
    max_connections_per_client: int = 64
    """Open connections from one client address; a new one beyond it gets 429 and is closed
    (slow clients from one address cannot hold every connection)."""

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_headers",
            "max_connections",
            "max_connections_per_client",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0, got {self.header_timeout}")


def limited_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """A uvicorn `http=` protocol class enforcing `limits`."""

    class Protocol(LimitedHttpToolsProtocol):
        pass

    Protocol.limits = limits
    return Protocol


class _LimitExceeded(Exception):
    """Raised inside a parser callback to stop parsing a request that broke a limit."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._num_headers = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._answered = False

    # ---- connection ----
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._answer(
                503,
                f"too many open connections (the limit is {self.limits.max_connections}); "
                "retry later",
                "overloaded",
                retry_after=True,
            )
            return
        host = self.client[0] if self.client else None
        if host is not None:
            same = sum(1 for c in self.connections if c.client and c.client[0] == host)
            if same > self.limits.max_connections_per_client:
                self._answer(
                    429,
                    f"too many open connections from {host} (the limit is "
                    f"{self.limits.max_connections_per_client} per client); retry later",
                    "too_many_connections",
                    retry_after=True,
                )
                return
        # A connection that never sends a byte is closed like an idle keep-alive one.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            if isinstance(e.__cause__ or e.__context__, _LimitExceeded):
                return  # already answered
            logger.warning("invalid HTTP request from %s: %s", self.client, e)
            self._answer(400, f"invalid HTTP request: {e}", "invalid_http_request")

    # ---- parser callbacks ----
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._num_headers = 0
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout, self._on_header_timeout
        )

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools may deliver one header in pieces: count bytes always, fields by name.
        self._count_header_bytes(len(name) + len(value))
        if name:
            self._num_headers += 1
            if self._num_headers > self.limits.max_headers:
                self._reject(431, f"more than {self.limits.max_headers} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    # ---- limits ----
    def _count_header_bytes(self, num_bytes: int) -> None:
        self._header_bytes += num_bytes
        if self._header_bytes > self.limits.max_header_bytes:
            self._reject(431, f"the request headers exceed {self.limits.max_header_bytes} bytes")

    def _reject(self, status: int, message: str) -> None:
        self._answer(status, message, "request_header_fields_too_large")
        raise _LimitExceeded(message)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self._answered and not self.transport.is_closing():
            self._answer(
                408,
                f"the request headers did not arrive within {self.limits.header_timeout:g} s",
                "request_timeout",
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _answer(self, status: int, message: str, code: str, retry_after: bool = False) -> None:
        """Writes an OpenAI-shaped error response and closes the connection."""
        self._answered = True
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        error_type = {503: "service_unavailable_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error"
        )
        body = json.dumps(error_body(message, error_type, None, code)).encode()
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if retry_after:
            head.append(b"retry-after: 1\r\n")
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


# ---- body limits (applied by the app's middleware) ----
def timed_receive(receive: Receive, timeout: float) -> Receive:
    """`receive` whose request body must be complete within `timeout` seconds of the first
    call (a client trickling its body gets 408 instead of holding the request forever)."""
    deadline: float | None = None
    done = False

    async def receive_timed() -> Message:
        nonlocal deadline, done
        if done:
            return await receive()
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout
        try:
            message = await asyncio.wait_for(receive(), max(deadline - now, 0.0))
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    return receive_timed


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1
_DEPTH_OFF_LOOP_BYTES = 1 << 16


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays / objects in `body` (brackets inside strings do not count);
    linear time, no recursion."""
    if b"[" not in body and b"{" not in body:
        return 0
    stripped = _JSON_STRING.sub(b"", body)
    steps = _OPEN[np.frombuffer(stripped, dtype=np.uint8)]
    steps = steps[steps != 0].astype(np.int32)
    return int(np.cumsum(steps).max()) if len(steps) else 0


def check_json_depth(receive: Receive, max_depth: int = MAX_JSON_DEPTH) -> Receive:
    """`receive` that checks the nesting depth of a JSON body once it is complete (a large body
    off the event loop): deeper than `max_depth` is a 400."""
    chunks: list[bytes] = []

    async def receive_checked() -> Message:
        message = await receive()
        if message["type"] != "http.request":
            return message
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return message
        body = b"".join(chunks)
        chunks.clear()
        if len(body) > _DEPTH_OFF_LOOP_BYTES:
            depth = await asyncio.to_thread(json_depth, body)
        else:
            depth = json_depth(body)
        if depth > max_depth:
            raise APIError(
                400,
                f"the JSON body is nested {depth} levels deep; at most {max_depth} levels are "
                "accepted",
                code="json_too_deep",
            )
        return message

    return receive_checked


_UPLOAD_READ_BYTES = 1 << 20


async def read_upload_bounded(upload: UploadFile, limit: int, param: str = "file") -> bytes:
    """The bytes of an uploaded file, read 1 MiB at a time into one buffer that never holds
    more than `limit` + 1 MiB: past `limit` it stops reading and answers 413 (a declared size
    over the limit is refused before any read)."""

    def too_large(size: str) -> APIError:
        return APIError(
            413,
            f"the uploaded file is {size} bytes, more than the limit of {limit} bytes",
            param=param,
            code="payload_too_large",
        )

    if upload.size is not None and upload.size > limit:
        raise too_large(str(upload.size))
    buffer = bytearray()
    while True:
        chunk = await upload.read(_UPLOAD_READ_BYTES)
        if not chunk:
            return bytes(buffer)
        buffer += chunk
        if len(buffer) > limit:
            raise too_large(f"more than {len(buffer) - len(chunk)}")
