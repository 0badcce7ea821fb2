"""Errors the core and its clients raise to their callers: the engine is dead (the core
process, or a worker behind it, is gone: every pending and later request fails with
`EngineDeadError`), the core could not start, a utility call failed inside it."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore died; every pending and later request fails with this."""


class WorkerDeadError(EngineDeadError):
    """A worker process (a tensor-parallel rank) is gone: the engine cannot step any more and
    dies loudly, as when its core dies (every pending request fails with EngineDeadError)."""


class EngineCoreStartError(RuntimeError):
    """The EngineCore process could not start (its error is in the message)."""


class UtilityCallError(RuntimeError):
    """A utility method raised inside the EngineCore (its error is in the message)."""
