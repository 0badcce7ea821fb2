"""Which attention backend serves a device: a registry with lazy imports."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

from v1.attention.backend import AttentionBackend

_BACKENDS = {
    "torch_sdpa": "v1.attention.backends.torch_sdpa:TorchSDPABackend",
    "triton": "v1.attention.backends.triton:TritonBackend",
    "flash_attn": "v1.attention.backends.flash_attn:FlashAttnBackend",
}
_current: str | None = None


def load_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _importable(name: str) -> bool:
    try:
        load_backend(name)
    except ImportError:
        return False
    return True


def default_backend_name(
    device_type: str, block_size: int = 16, needs_bias: bool = False, fp8_kv_cache: bool = False
) -> str:
    """flash_attn when installed and usable (no bias, no fp8 cache, 256-token blocks), else
    triton on CUDA (fp8 caches: on sm89+, where Triton has float8e4nv), else torch_sdpa."""
    if device_type != "cuda":
        return "torch_sdpa"
    if not needs_bias and not fp8_kv_cache and block_size % 256 == 0 and _importable("flash_attn"):
        return "flash_attn"
    if fp8_kv_cache and not _has_fp8_triton():
        return "torch_sdpa"
    return "triton" if _importable("triton") else "torch_sdpa"


def _has_fp8_triton() -> bool:
    import torch

    return torch.cuda.get_device_capability() >= (8, 9)


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
