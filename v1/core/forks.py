"""`ForkManager`: finished `hold_kv` requests (a beam step) whose KV blocks stay held for the
requests naming them in `fork_from`, which take those blocks when admitted. A held request is
freed once released (an abort naming it, or its `last_fork` child) and no registered fork waits,
or at once when evicted for room. Pure bookkeeping: the scheduler frees the blocks handed back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from v1.core.request import Request


@dataclass(eq=False)
class HeldRequest:
    """A finished request whose KV blocks are kept, and who still waits to fork from it."""

    request: Request
    num_waiting_forks: int = 0
    """Waiting requests registered to fork from it."""
    released: bool = False
    """No further fork will register: freed once num_waiting_forks reaches 0."""


class ForkManager:
    """Owns the lifecycle of held requests: hold, register forks, release, evict."""

    def __init__(self) -> None:
        self.held: OrderedDict[str, HeldRequest] = OrderedDict()
        """Held requests by id, oldest first (the eviction order)."""
        self._forks: dict[str, HeldRequest] = {}
        """Waiting request id -> the held request it forks from."""

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.held

    def hold(self, request: Request) -> None:
        """Keeps a finished `hold_kv` request (its blocks stay with the KV cache manager)."""
        assert request.request_id not in self.held
        self.held[request.request_id] = HeldRequest(request)

    def register(self, request: Request) -> None:
        """A new request names `fork_from`: it waits on that held request, or forks from
        nothing (fork_from cleared) when that request is not held."""
        entry = self.held.get(request.fork_from) if request.fork_from is not None else None
        if entry is None:
            request.fork_from = None
            return
        entry.num_waiting_forks += 1
        entry.released = entry.released or request.last_fork
        self._forks[request.request_id] = entry

    def source(self, request: Request) -> Request | None:
        """The held request a waiting request may fork from now (None when it registered
        none or that one was evicted)."""
        entry = self._forks.get(request.request_id)
        if entry is None or self.held.get(entry.request.request_id) is not entry:
            return None
        return entry.request

    def is_last_fork(self, request: Request) -> bool:
        """Whether the source is freed right after this request forks (it may take the
        source's partial block instead of copying it)."""
        entry = self._forks[request.request_id]
        return entry.released and entry.num_waiting_forks == 1

    def unregister(self, request: Request) -> list[Request]:
        """The request was admitted (forked or not) or ended while waiting: it no longer waits
        on its source. Returns the source when that frees it."""
        request.fork_from = None
        entry = self._forks.pop(request.request_id, None)
        if entry is None:
            return []
        entry.num_waiting_forks -= 1
        return self._free_if_done(entry)

    def release(self, req_id: str) -> list[Request]:
        """No further fork of `req_id` (an abort naming it). Returns it when it is held and
        no fork waits for it (free it now); otherwise its last waiting fork frees it."""
        entry = self.held.get(req_id)
        if entry is None:
            return []
        entry.released = True
        return self._free_if_done(entry)

    def evict_oldest(self) -> Request | None:
        """Gives up the oldest held request (its waiting forks compute their tokens instead)."""
        if not self.held:
            return None
        _, entry = self.held.popitem(last=False)
        return entry.request

    def evict(self, req_id: str) -> Request | None:
        """Gives up the held request `req_id`, if any (a new request takes its id)."""
        entry = self.held.pop(req_id, None)
        return entry.request if entry is not None else None

    def _free_if_done(self, entry: HeldRequest) -> list[Request]:
        req_id = entry.request.request_id
        if entry.released and entry.num_waiting_forks == 0 and self.held.get(req_id) is entry:
            del self.held[req_id]
            return [entry.request]
        return []
