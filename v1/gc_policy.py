"""Python's cyclic GC around the engine's step loops.

A full (generation-2) collection scans every tracked object that is not frozen. The engines freeze
their start-up objects (model, tokenizer, configs), but a large batch's own requests, token lists
and logprob lists are created during the run and reach generation 2 after two collections. With
512 Whisper windows in flight a full collection then takes 12-27 ms on an H100 host, and Python's
default thresholds (700, 10, 10) start two or three of them per 2.6 s run, each one a gap of that
length in the device's queue (`benchmarks/step_gaps.py` records them).

`deferred_full_collections()` lets the young generations run as usual (they collect short-lived
cycles) and makes full collections `FULL_COLLECTION_FACTOR` times rarer while a batch loop runs;
the thresholds are restored after it, and the next automatic collection catches up. A process
that only steps an engine (the EngineCore process) keeps the raised threshold for its lifetime.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

FULL_COLLECTION_FACTOR = 20
"""Generation-1 collections between two full ones: 10 (Python's default) times this."""


def raise_full_collection_threshold() -> tuple[int, int, int]:
    """Makes full collections FULL_COLLECTION_FACTOR times rarer; returns the old thresholds."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], old[2] * FULL_COLLECTION_FACTOR)
    return old


@contextmanager
def deferred_full_collections() -> Iterator[None]:
    """Full collections FULL_COLLECTION_FACTOR times rarer inside; nested blocks (a
    transcription inside a batch loop) leave the outermost one in charge."""
    if _open_blocks[0]:
        _open_blocks[0] += 1
        try:
            yield
        finally:
            _open_blocks[0] -= 1
        return
    old = raise_full_collection_threshold()
    _open_blocks[0] = 1
    try:
        yield
    finally:
        _open_blocks[0] = 0
        gc.set_threshold(*old)


_open_blocks = [0]
"""Open `deferred_full_collections` blocks in this process."""
