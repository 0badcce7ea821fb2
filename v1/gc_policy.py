"""Python's cyclic GC around the engine's step loops.

A full (generation-2) collection scans every tracked object that is not frozen. The engines freeze
their start-up objects (model, tokenizer, configs), but a large batch's own requests, token lists
and logprob lists are created during the run and reach generation 2 after two collections. With
512 Whisper windows in flight a full collection then takes 12-27 ms on an H100 host, and Python's
default thresholds (700, 10, 10) start two or three of them per 2.6 s run, each one a gap of that
length in the device's queue (`benchmarks/step_gaps.py` records them).

`deferred_full_collections()` lets the young generations run as usual (they collect short-lived
cycles) and makes full collections `FULL_COLLECTION_FACTOR` times rarer than Python's default
while a batch loop runs; the thresholds are restored after it, and the next automatic
collection catches up. A process that only steps an engine (the EngineCore process) keeps the
raised threshold for its lifetime.
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
