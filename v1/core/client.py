"""EngineCoreClient: one interface over an in-process core (`inproc_client`), a core process
driven synchronously (offline LLM) and one driven from asyncio (AsyncLLM, the server)
(`mp_client`, `dp_client`). Which one runs is chosen above the core (v1.engine.core_client).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from v1.core.protocol import EngineCoreOutputs, EngineCoreRequest


class HeldAdds(threading.local):
    """Per thread: the requests an open `batched_adds` block holds (None: no block open).
    `empty()` makes an empty holding (a list, or a dict per core); `send(held)` sends a
    non-empty one."""

    requests: Any = None

    def __init__(self, empty: Callable[[], Any], send: Callable[[Any], None]) -> None:
        self._empty = empty
        self._send = send

    @contextmanager
    def block(self) -> Iterator[None]:
        """A `batched_adds` block; a nested one leaves the sending to the outer one."""
        if self.requests is not None:
            yield
            return
        self.requests = self._empty()
        try:
            yield
        finally:
            self.flush()
            self.requests = None

    def flush(self) -> None:
        """Sends what this thread's open block holds (before any other message of the thread:
        an abort or utility call keeps its place after the adds made before it)."""
        if self.requests:
            held, self.requests = self.requests, self._empty()
            self._send(held)


class EngineCoreClient(ABC):
    runs_ahead: bool = True
    """The core steps on its own (another process): `get_output` reads what it has done, so a
    synchronous frontend must queue work ahead of it. False for an in-process core, which
    steps only inside `get_output`."""

    # sync interface
    def add_request(self, request: EngineCoreRequest) -> None:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def batched_adds(self) -> AbstractContextManager[None]:
        """Inside it, this thread's `add_request` calls may be held and sent together when it
        ends (one message per core instead of one per request: an offline batch's top-up).
        The requests reach the core in call order; an abort or utility call made inside the
        block first sends what it holds, so every message keeps its place."""
        return nullcontext()

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    # asyncio interface
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is synchronous")

    @abstractmethod
    def shutdown(self) -> None: ...
