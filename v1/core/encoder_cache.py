"""EncoderCacheManager: which encoder outputs the runner holds, keyed by content hash.

Capacity is counted in encoder positions. Entries referenced by no request stay cached (so the
same audio or text encodes once across requests) until space is needed; evicted hashes are
reported to the runner through SchedulerOutput.free_encoder_hashes.
"""

from __future__ import annotations

from collections import OrderedDict

from v1.core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.entries: dict[str, int] = {}
        """hash -> encoder positions it occupies."""
        self.refs: dict[str, set[str]] = {}
        """hash -> ids of requests using it."""
        self.freeable: OrderedDict[str, int] = OrderedDict()
        """Unreferenced entries, oldest first (evicted first)."""
        self._freed: list[str] = []

    def has(self, content_hash: str) -> bool:
        return content_hash in self.entries

    def can_allocate(self, num_tokens: int) -> bool:
        reclaimable = sum(self.freeable.values())
        return num_tokens <= self.num_free_slots + reclaimable

    def add_ref(self, request: Request) -> None:
        """Point `request` at its (already cached) encoder output."""
        content_hash = request.encoder_hash
        assert content_hash in self.entries, content_hash
        self.refs[content_hash].add(request.request_id)
        self.freeable.pop(content_hash, None)

    def allocate(self, request: Request) -> None:
        """Reserve room for the request's encoder output (to be computed this step)."""
        content_hash, num_tokens = request.encoder_hash, request.num_encoder_tokens
        assert content_hash is not None and content_hash not in self.entries
        while self.num_free_slots < num_tokens:
            old_hash, old_size = self.freeable.popitem(last=False)
            del self.entries[old_hash]
            del self.refs[old_hash]
            self.num_free_slots += old_size
            self._freed.append(old_hash)
        self.entries[content_hash] = num_tokens
        self.refs[content_hash] = {request.request_id}
        self.num_free_slots -= num_tokens

    def free(self, request: Request) -> None:
        """Drop the request's reference (idempotent); the output stays cached while space lasts."""
        content_hash = request.encoder_hash
        refs = self.refs.get(content_hash) if content_hash is not None else None
        if refs is None or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[content_hash] = self.entries[content_hash]

    def take_freed_hashes(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Evict every unreferenced entry."""
        for content_hash, size in list(self.freeable.items()):
            del self.entries[content_hash]
            del self.refs[content_hash]
            self.num_free_slots += size
            self._freed.append(content_hash)
        self.freeable.clear()
