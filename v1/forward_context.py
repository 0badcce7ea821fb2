"""The per-step forward context: attention metadata each Attention layer reads by its name.

The runner sets it around a step's forward; layers read it, never build it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: dict[str, Any] = field(default_factory=dict)
    """layer name -> backend metadata (layers of one KV group share one object)."""
    profiling: bool = False
    """A memory-profiling pass before the KV cache exists: attention layers return zeros."""
    cross_kv_only: bool = False
    """The cross-K/V pre-step of encoder-decoder models: cross-attention layers only write the
    projected encoder output to their cross blocks; every attention layer returns zeros."""


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return _forward_context


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _forward_context
    prev, _forward_context = _forward_context, context
    try:
        yield
    finally:
        _forward_context = prev
