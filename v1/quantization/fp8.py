"""FP8 (float8_e4m3fn) quantization: one float32 scale per row of the last dimension.

`quantize_rows` is the one quantizer of the engine: Linear weights (a row = an output channel),
activations (a row = a token) and cached K/V rows (a row = one head of one token) or encoder
states (a row = one encoder position). Dequantizing is `q.float() * scale[..., None]`.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12
"""Scale of an all-zero row (any positive value dequantizes it to zeros)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (fp8 [..., n], float32 scales [...]) with x ~= q * scale[..., None]; each
    row's largest magnitude maps to the fp8 maximum (448)."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_rows` (up to fp8 rounding), in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)
