"""Python's cyclic GC around the engine's step loops.

`deferred_full_collections()` leaves the young generations as they are and makes full
collections `FULL_COLLECTION_FACTOR` times rarer while a batch loop runs, restoring the
thresholds after it; the EngineCore process keeps them raised (why: docs/decisions.md).
`paused_collections()` (offline pooling batches) turns automatic collections off and runs one
young collection every `PAUSED_COLLECTION_STEPS` steps instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

FULL_COLLECTION_FACTOR = 20
"""Generation-1 collections between two full ones: at least Python's default (10) times this."""

_FULL_COLLECTION_THRESHOLD = 10 * FULL_COLLECTION_FACTOR

PAUSED_COLLECTION_STEPS = 64
"""Steps between two young (generation 0 and 1) collections while collections are paused: a
4096-input MiniLM batch is ~17 steps, so none runs in it; a long batch still collects its
cycles."""


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


@contextmanager
def paused_collections() -> Iterator[Callable[[], None]]:
    """Automatic cyclic collections off inside (process-wide), back as they were after; yields
    `tick`, to call once a step: every PAUSED_COLLECTION_STEPS-th call runs one generation-1
    collection, so cycles made by a long batch are still freed. For offline pooling batches:
    their requests die by reference counting, yet young collections scanning the thousands of
    live requests and outputs cost ~11% of the host time of a 4096-input MiniLM `embed` (CPU,
    `benchmarks/pooling_host.py`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    steps = 0

    def tick() -> None:
        nonlocal steps
        steps += 1
        if steps % PAUSED_COLLECTION_STEPS == 0:
            gc.collect(1)

    try:
        yield tick
    finally:
        if was_enabled:
            gc.enable()
