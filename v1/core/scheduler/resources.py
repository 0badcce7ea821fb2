"""`RequestResources`: frees or holds what a request owns outside the queues (KV blocks, its
encoder-cache reference, held KV for forks) and collects the ids the runner must drop. A
request leaves `requests` exactly once, when it finishes; held ones stay with `forks`.
"""

from __future__ import annotations

from v1.core.encoder_cache import EncoderCacheManager
from v1.core.forks import ForkManager
from v1.core.request import Request, RequestStatus
from v1.kv_cache.manager import KVCacheManager

_HOLDS_KV = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
"""Finishes after which a `hold_kv` request keeps its blocks for forks (not aborts, errors)."""


class RequestResources:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        encoder_cache: EncoderCacheManager,
        forks: ForkManager,
        requests: dict[str, Request],
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.encoder_cache = encoder_cache
        self.forks = forks
        self.requests = requests
        """Every request not finished, by id (the scheduler's table)."""
        self.finished_req_ids: set[str] = set()
        """Requests finished or preempted since the last step: the runner drops its copies."""
        self.num_held_evictions = 0
        """Held requests freed for room (their forks compute their tokens again)."""

    def release(self, request: Request) -> None:
        """A finished request's resources: held for forks (hold_kv), else freed."""
        if request.hold_kv and request.status in _HOLDS_KV:
            self._hold(request)
        else:
            self.free(request)

    def free(self, request: Request) -> None:
        """Frees a finished (or aborted) request's blocks and encoder reference."""
        self.kv_cache_manager.free(request)
        self.encoder_cache.free(request)
        if request.fork_from is not None:  # ended while waiting to fork
            self.free_held(self.forks.unregister(request))
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _hold(self, request: Request) -> None:
        """A finished `hold_kv` request: its blocks stay (full ones registered in the prefix
        cache) for the requests that fork from it; everything else goes as for a finish."""
        self.kv_cache_manager.cache_computed_blocks(request)
        self.encoder_cache.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.forks.hold(request)

    def free_held(self, requests: list[Request]) -> None:
        for request in requests:
            self.kv_cache_manager.free(request)

    def release_held(self, req_id: str) -> None:
        """No further fork of `req_id` will come: a held request is freed once the forks that
        registered are admitted (unknown or live ids are ignored)."""
        self.free_held(self.forks.release(req_id))

    def evict_held(self) -> bool:
        """Frees the oldest held request for room; False when none is held."""
        request = self.forks.evict_oldest()
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        self.num_held_evictions += 1
        return True

    def take_finished_req_ids(self) -> set[str]:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return finished
