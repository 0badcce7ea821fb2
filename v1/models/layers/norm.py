"""Normalization layers: RMSNorm and LayerNorm (float32 inside, cast back), and
`add_layer_norm`, the residual add + LayerNorm (one Triton kernel on CUDA for large 16-bit
batches or under CUDA graph capture, `triton_norm.py`; the torch path here is its reference).
RMSNorm's residual add + norm is likewise one kernel (`triton_rms_norm.py`). A LayerNorm feeding only fp8
Linears (`fp8_output`) hands over `v1.quantization.fp8_rows.Fp8Rows` from the same kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from v1 import envs
from v1.quantization.fp8_rows import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Product, Fp8Rows, fp8_rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        pre-norm block's fused add, so the caller carries the un-normalized sum forward.
        One Triton kernel (`triton_rms_norm.py`) under `use_fused_elementwise`; the torch path
        here is its reference."""
        if use_fused_elementwise(x) and (
            residual is None or (residual.stride(-1) == 1 and residual.dtype == x.dtype)
        ):
            from v1.models.layers.triton_rms_norm import add_rms_norm_triton

            out, h = add_rms_norm_triton(x, residual, self.weight, self.eps)
            return out if h is None else (out, h)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None
        self.eps = eps
        self.fp8_output = False
        """Every consumer of the output is an fp8 Linear (set after quantizing, by the layer
        that owns the norm): `add_layer_norm` and `linear_input` return `Fp8Rows`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


FUSED_MIN_ROWS = 2048
"""Below this many rows an eager fused launch costs more host time (Triton's launcher) than
the second kernel it saves: measured on an H100, add + LayerNorm of [256, 1280] took 33 us as
two torch kernels and 59 us as one Triton launch; [48000, 1280] took 258 us against 172 us."""


def fp16_clamp_limit(dtype: torch.dtype) -> float | None:
    """transformers clamps fp16 encoder layer outputs to +-(max - 1000); None for other dtypes."""
    return torch.finfo(torch.float16).max - 1000 if dtype == torch.float16 else None


def _fusable(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.dim() == 2
        and x.stride(1) == 1
    )


def use_fused_kernel(x: torch.Tensor) -> bool:
    """Whether `add_layer_norm` runs its Triton kernel on x: CUDA, 16 bits, 2-D with
    contiguous columns, and either many rows or a CUDA graph being captured (where launch
    cost is paid once, at capture, and the kernel saved is saved on every replay)."""
    return _fusable(x) and (
        x.shape[0] >= FUSED_MIN_ROWS or torch.cuda.is_current_stream_capturing()
    )


def use_fused_elementwise(x: torch.Tensor) -> bool:
    """Whether RMSNorm, SiluAndMul and RoPE run their Triton kernel on x: CUDA, 16 bits, 2-D
    with contiguous columns, at any number of rows. Each kernel replaces 2 to 20 torch
    kernels (RMSNorm's add, float, pow, mean, add, rsqrt, mul, to, mul; RoPE's cos / sin and
    slices, cats, negs, muls and adds), so a launch saves host time even eagerly, unlike the
    one kernel `add_layer_norm` saves. And they must run eagerly at decode sizes: a CUDA
    graph's warm-up step is eager at the captured size, and it is what compiles and loads a
    Triton kernel before the capture (loading a module, cuModuleLoadData, is not permitted
    while a stream is capturing). Everywhere else the torch path, each kernel's reference."""
    return _fusable(x)


def use_fused_encoder(x: torch.Tensor) -> bool:
    """Whether an encoder-only step's embedding and pooling kernels
    (`triton_encoder.py`) take x: `use_fused_elementwise` and `V1_FUSED_ENCODER`."""
    return envs.V1_FUSED_ENCODER and _fusable(x)


def linear_input(norm: LayerNorm, y: torch.Tensor) -> Any:
    """A norm's output y as its Linears take it: y, or `Fp8Rows` of y (`norm.fp8_output`)."""
    if not norm.fp8_output:
        return y
    return fp8_rows(y)


def add_layer_norm(
    x: Any,
    residual: torch.Tensor,
    norm: LayerNorm,
    store_residual: bool = True,
    clamp: float | None = None,
    residual_bias: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """(norm(h), h) with h = x + residual, clamped to +-clamp when given (h is None unless
    `store_residual`): a pre-norm block's residual stream and the next sub-block's input, or
    (store_residual=False) a post-norm block's output. norm(h) comes as `linear_input` gives
    it (quantized in the same kernel when fused). x may be an fp8 Linear's `Fp8Product`
    (scaled in the same kernel); `residual_bias` is added to the returned h only (the bias
    of the Linear whose product the next add brings: `BartEncoderLayer.link_fp8_norms`)."""
    scales = None
    if isinstance(x, Fp8Product):
        if use_fused_kernel(x.out) and residual.stride(-1) == 1:
            scales, x = (x.row_scale, x.col_scale), x.out
        else:
            x = x.dequantize()
    if use_fused_kernel(x) and residual.stride(-1) == 1:
        from v1.models.layers.triton_norm import add_layer_norm_triton

        fp8 = (FP8_DTYPE, FP8_MAX, MIN_SCALE) if norm.fp8_output else None
        normed, h = add_layer_norm_triton(
            x,
            residual,
            norm.weight,
            norm.bias,
            norm.eps,
            store_residual,
            clamp,
            fp8,
            scales,
            residual_bias,
        )
        return (Fp8Rows(*normed, x.dtype) if fp8 else normed), h
    h = x + residual
    if clamp is not None:
        h = h.clamp(-clamp, clamp)
    normed = linear_input(norm, norm(h))
    if not store_residual:
        return normed, None
    return normed, (h if residual_bias is None else h + residual_bias)
