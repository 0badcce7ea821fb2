"""Errors the core raises to its callers: the engine is dead (the core process, or a worker
behind it, is gone). Every pending and later request fails with `EngineDeadError`."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore died; every pending and later request fails with this."""


class WorkerDeadError(EngineDeadError):
    """A worker process (a tensor-parallel rank) is gone: the engine cannot step any more and
    dies loudly, as when its core dies (every pending request fails with EngineDeadError)."""
