"""FlashAttention-4's CuTe DSL kernels (the optional `flash-attn-4` package, imported as
`flash_attn.cute`) for equal-length bidirectional batches without a KV cache: Whisper's
encoder windows.

H200, 32 windows of large-v3 (20 heads of 64, 1500 positions, q/k/v strided views of one qkv
projection): FA4 0.824 ms against cuDNN's 0.969 ms and aten flash's 1.356 ms, outputs within
2.4e-4 of cuDNN's (benchmarks/fa4_attention.py, RESULTS.md session 24). The kernels compile
on first use (~1.7 s per configuration) and the package imports in ~7 s, both once per
process, inside the encoder warm-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from v1 import envs
from v1.logger import init_logger

logger = init_logger(__name__)

MIN_BATCH = 8
"""Fewer sequences stay on cuDNN: FA4's Python launch path costs ~0.1 ms of host a call, more
than cuDNN's device time for 1-2 windows (0.07-0.08 ms); at 8 windows FA4 is ahead (0.223
against 0.258 ms, H200)."""

_DENSE: list[Callable[..., Any] | None] = []
"""The loaded `flash_attn_func` (None: not installed, turned off or failed), once looked up."""


def wanted(mode: str, capability: tuple[int, int]) -> bool:
    """Whether V1_FA4=`mode` asks for FA4 on a GPU of this compute capability: "auto" takes it
    on Hopper (9.x, the only family it was measured on here), "1" wherever the package runs
    (8.x-12.x), "0" never."""
    if mode == "0":
        return False
    if mode == "1":
        return 8 <= capability[0] <= 12
    return capability[0] == 9


def _load(device: torch.device) -> Callable[..., Any] | None:
    if _DENSE:
        return _DENSE[0]
    if device.type != "cuda":
        return None
    fn = None
    if wanted(envs.V1_FA4, torch.cuda.get_device_capability(device)):
        try:
            from flash_attn.cute import flash_attn_func

            fn = flash_attn_func
            logger.info("FlashAttention-4 (flash_attn.cute) runs equal-length encoder batches")
        except Exception as e:  # noqa: BLE001 - not installed, or its CUDA libraries refuse
            logger.debug("FlashAttention-4 not used: %s", e)
    _DENSE.append(fn)
    return fn


def available(device: torch.device) -> bool:
    """Whether equal-length encoder batches of MIN_BATCH+ sequences go to FA4 here."""
    return _load(device) is not None


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int, scale: float
) -> torch.Tensor | None:
    """Packed rows [batch * length, H, D] of equal-length sequences (rows may be strided, as
    views of one qkv projection) -> [batch * length, H, D]; None where FA4 is not used here
    (not installed, V1_FA4, fewer than MIN_BATCH sequences, not 16-bit) or failed (then never
    again in this process)."""
    if batch < MIN_BATCH or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    fn = _load(q.device)
    if fn is None:
        return None
    try:
        out, _ = fn(
            q.unflatten(0, (batch, length)),
            k.unflatten(0, (batch, length)),
            v.unflatten(0, (batch, length)),
            softmax_scale=scale,
        )
    except Exception as e:  # noqa: BLE001 - any refusal of a shape or build: cuDNN from now on
        logger.warning("FlashAttention-4 failed (%s); using cuDNN attention", e)
        _DENSE[0] = None
        return None
    return out.flatten(0, 1)
