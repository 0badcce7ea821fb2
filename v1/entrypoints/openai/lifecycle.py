"""How the server stops: a drain on SIGTERM / SIGINT and an exit when the engine dies.

Drain (`--shutdown-timeout`): new requests get 503 + Retry-After while in-flight work finishes,
then the rest is failed and the server exits 0. Engine death: in-flight work fails at once and
the server exits 1, unless `--keep-alive-on-engine-death`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from v1.logger import init_logger

logger = init_logger(__name__)

ENGINE_DEATH_EXIT_CODE = 1
_POLL_S = 0.05
_FAIL_GRACE_S = 2.0
"""After failing the remaining work, how long its responses get to go out."""


class ServerLifecycle:
    """Shared by the middleware (what to answer while draining) and the uvicorn server."""

    def __init__(self, shutdown_timeout: float, keep_alive_on_engine_death: bool) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.draining = False
        self.exit_code = 0
        self.in_flight: Callable[[], int] = lambda: 0
        """Requests holding engine work (set by the middleware)."""
        self._request_exit: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task] = set()

    def bind(self, request_exit: Callable[[], None]) -> None:
        """`request_exit` makes the HTTP server stop accepting and return from `run`."""
        self._request_exit = request_exit

    # ---- drain ----
    def start_drain(self, engine: Any) -> None:
        """Begins the drain (idempotent); call on the event loop."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "draining: %d requests in flight, up to %g s (--shutdown-timeout)",
            self.in_flight(),
            self.shutdown_timeout,
        )
        self._spawn(self._drain(engine))

    async def _drain(self, engine: Any) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if self.in_flight() > 0:
            logger.warning(
                "shutdown timeout: failing %d requests still in flight", self.in_flight()
            )
            await self._fail_remaining(engine)
        self._request_exit()

    # ---- engine death ----
    def watch_engine(self, engine: Any) -> None:
        """Exits the server (code 1) once the engine dies, unless kept alive."""
        self._spawn(self._watch(engine))

    async def _watch(self, engine: Any) -> None:
        while not engine.errored:
            await asyncio.sleep(0.1)
        if self.keep_alive_on_engine_death or self.draining:
            return
        logger.error(
            "the engine died (%s); exiting with code %d (--keep-alive-on-engine-death keeps "
            "the server up)",
            engine.dead_error,
            ENGINE_DEATH_EXIT_CODE,
        )
        self.draining = True
        self.exit_code = ENGINE_DEATH_EXIT_CODE
        await self._wait_in_flight(_FAIL_GRACE_S)  # they are failing already
        self._request_exit()

    # ---- the other API server processes ----
    def watch_children(self, children: Any) -> None:
        """Exits the server (code 1) once another API server process exits on its own: its
        share of the connections would be refused, so the server as a whole is down."""
        self._spawn(self._watch_children(children))

    async def _watch_children(self, children: Any) -> None:
        while (exited := children.exited()) is None:
            await asyncio.sleep(0.2)
        if self.draining:
            return
        logger.error("API server process %d exited with code %s; exiting", *exited)
        self.draining = True
        self.exit_code = ENGINE_DEATH_EXIT_CODE
        children.drain()
        await self._wait_in_flight(self.shutdown_timeout)
        self._request_exit()

    # ---- helpers ----
    async def _fail_remaining(self, engine: Any) -> None:
        engine.shutdown()  # every pending request ends with an error
        await self._wait_in_flight(_FAIL_GRACE_S)

    async def _wait_in_flight(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT starts a drain instead of closing the
    listener; a second one exits at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: ServerLifecycle,
        engine: Any,
        children: Any = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """`children`: the other API server processes (`ApiServerProcesses`), or None;
        `on_started()`: called once the server listens."""
        super().__init__(config)
        self.lifecycle = lifecycle
        self.engine = engine
        self.children = children
        self.on_started = on_started
        self._loop: asyncio.AbstractEventLoop | None = None
        lifecycle.bind(self._exit)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.lifecycle.watch_engine(self.engine)
        if self.children is not None:
            self.lifecycle.watch_children(self.children)
        try:
            await super().serve(sockets)
        finally:
            self.lifecycle.cancel()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.on_started is not None and self.started:
            self.on_started()

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining or self._loop is None:
            super().handle_exit(sig, frame)  # second signal: uvicorn's own (forced) exit
            return
        logger.info("got %s", signal.Signals(sig).name)
        if self.children is not None:
            self.children.drain()  # each drains its own requests
        self._loop.call_soon_threadsafe(self.lifecycle.start_drain, self.engine)
