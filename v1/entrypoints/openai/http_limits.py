"""HTTP connection limits the ASGI app cannot enforce (it sees a request only once its headers
are in): header size and count, a header-read timeout, an idle timeout for connections that send
nothing, and a cap on open connections. A uvicorn httptools protocol subclass; the answers it
sends itself (431, 408, 503, 400 for unparseable requests) carry the OpenAI error body too.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from v1.entrypoints.openai.errors import error_body
from v1.logger import init_logger

logger = init_logger(__name__)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_REASONS[503] = b"Service Unavailable"


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

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_connections"):
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
        error_type = "service_unavailable_error" if status == 503 else "invalid_request_error"
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
