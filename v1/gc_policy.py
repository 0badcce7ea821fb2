"""Python's cyclic GC around the engine's step loops.

`deferred_full_collections()` leaves the young generations as they are and makes full
collections `FULL_COLLECTION_FACTOR` times rarer while a batch loop runs, restoring the
thresholds after it; the EngineCore process keeps them raised (why: docs/decisions.md).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

FULL_COLLECTION_FACTOR = 20
"""Generation-1 collections between two full ones: at least Python's default (10) times this."""

_FULL_COLLECTION_THRESHOLD = 10 * FULL_COLLECTION_FACTOR


def raise_full_collection_threshold() -> tuple[int, int, int]:
    """Makes full collections FULL_COLLECTION_FACTOR times rarer than Python's default (a
    threshold already that high stays); returns the old thresholds."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], max(old[2], _FULL_COLLECTION_THRESHOLD))
    return old


@contextmanager
def deferred_full_collections() -> Iterator[None]:
    """Full collections FULL_COLLECTION_FACTOR times rarer inside, the old thresholds back
    after; a nested block (a transcription inside a batch loop) finds them raised already."""
    old = raise_full_collection_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*old)
