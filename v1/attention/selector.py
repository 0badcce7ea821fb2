"""Which attention backend serves a model on a device: a registry with lazy imports, filtered
by each backend's `BackendCapabilities` against `AttentionNeeds`.

A backend is chosen by capability only; an `attention_backend` setting forces one, and a choice
that cannot serve the model raises a ValueError naming, per backend, why it was rejected.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from v1.attention.backend import AttentionBackend, AttentionType

_BACKENDS = {
    "flash_attn": "v1.attention.backends.flash_attn:FlashAttnBackend",
    "triton": "v1.attention.backends.triton:TritonBackend",
    "torch_sdpa": "v1.attention.backends.torch_sdpa:TorchSDPABackend",
}
"""Every backend, in order of preference (the first that fits serves)."""
_current: str | None = None


@dataclass(frozen=True)
class AttentionNeeds:
    """What a model on a device asks of its attention backend."""

    attn_types: frozenset[AttentionType]
    device_type: str
    compute_capability: tuple[int, int] | None = None
    """CUDA only (None: not CUDA, or not known)."""
    encoder_states: bool = False
    """Absorbed cross-attention: metadata of the encoder-states group."""
    bias: bool = False
    """An additive attention bias (T5 relative positions), in prefill and decode."""
    fp8_kv_cache: bool = False
    block_size: int = 16


def load_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def rejection(backend: type[AttentionBackend], needs: AttentionNeeds) -> str | None:
    """Why `backend` cannot serve `needs` (None: it can)."""
    caps = backend.capabilities
    cc = needs.compute_capability
    if needs.device_type not in caps.device_types:
        return f"runs on {'/'.join(sorted(caps.device_types))}, not {needs.device_type}"
    if cc is not None and caps.min_compute_capability and cc < caps.min_compute_capability:
        return f"needs compute capability {_cc(caps.min_compute_capability)}, device has {_cc(cc)}"
    missing = [p for p in caps.required_packages if importlib.util.find_spec(p) is None]
    if missing:
        return f"needs the {', '.join(missing)} package(s), not installed"
    types = sorted(t.value for t in needs.attn_types - caps.attn_types)
    if types:
        return f"builds no metadata for {', '.join(types)} attention"
    if needs.encoder_states and not caps.encoder_states:
        return "builds no encoder-states metadata (absorbed cross-attention)"
    if needs.bias and not caps.bias:
        return "takes no additive attention bias"
    if needs.fp8_kv_cache:
        if not caps.fp8_kv_cache:
            return "has no fp8 KV cache"
        fp8_cc = caps.fp8_min_compute_capability
        if cc is not None and fp8_cc and cc < fp8_cc:
            return f"fp8 KV cache needs compute capability {_cc(fp8_cc)}, device has {_cc(cc)}"
    if needs.block_size % caps.block_size_multiple:
        return f"block_size {needs.block_size} is not a multiple of {caps.block_size_multiple}"
    return None


def _cc(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _load_or_reason(name: str) -> tuple[type[AttentionBackend] | None, str | None]:
    try:
        return load_backend(name), None
    except ImportError as e:
        return None, f"cannot be imported ({e})"


def select_backend(needs: AttentionNeeds, forced: str = "auto") -> type[AttentionBackend]:
    """The first backend (in `_BACKENDS` order) that serves `needs`, or `forced` (a name; "auto"
    chooses) when it does; a ValueError names each rejected backend's reason otherwise."""
    if forced != "auto":
        backend, reason = _load_or_reason(forced)
        reason = reason or rejection(backend, needs)
        if reason:
            raise ValueError(f"attention_backend={forced!r} cannot serve this model: {reason}")
        return backend
    reasons = {}
    for name in _BACKENDS:
        backend, reason = _load_or_reason(name)
        reason = reason or rejection(backend, needs)
        if reason is None:
            return backend
        reasons[name] = reason
    listed = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise ValueError(f"no attention backend serves this model on {needs.device_type}: {listed}")


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Attention layers constructed inside this block use backend `name`."""
    global _current
    prev, _current = _current, name
    try:
        yield
    finally:
        _current = prev


def get_attn_backend() -> type[AttentionBackend]:
    return load_backend(_current or "torch_sdpa")
