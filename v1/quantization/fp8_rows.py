"""FP8 (float8_e4m3fn) rows: `quantize_rows`, the one quantizer of the engine, with one float32
scale per row of the last dimension (a Linear weight's output channel, a token's activations, one
head of cached K/V, one encoder position), and the quantized forms layers hand each other.
Floor 5: model layers and attention ops import it; it imports nothing of theirs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12
"""Scale of an all-zero row (any positive value dequantizes it to zeros)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (fp8 [..., n], float32 scales [...]) with x ~= q * scale[..., None]; each
    row's largest magnitude maps to the fp8 maximum (448)."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    # A multiply by the (correctly rounded) reciprocal, as the Triton quantizer does: a
    # division per element made that kernel compute-bound at twice the time.
    q = (x.float() * scale.reciprocal()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_rows` (up to fp8 rounding), in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


class Fp8Rows(NamedTuple):
    """Activations already quantized per row, handed to an fp8 Linear instead of a tensor: what
    a LayerNorm whose output feeds only fp8 Linears returns (`LayerNorm.fp8_output`), so the
    norm's kernel writes 8-bit rows once and the Linear skips its quantizer pass."""

    q: torch.Tensor
    """[..., K] float8_e4m3fn."""
    scale: torch.Tensor
    """[...] float32, one per row."""
    dtype: torch.dtype
    """The activations' own dtype: the Linear's output dtype."""


class Fp8Product(NamedTuple):
    """An fp8 Linear's output left for its consumer to scale (`unscaled_output` layers):
    the true output is out * row_scale[:, None] * col_scale[None, :], and the layer's bias is
    added by whoever owns it (see `BartEncoderLayer.link_fp8_norms`). The GEMM then runs with
    two scalar scales instead of per-row and per-channel vectors and a bias epilogue, which
    picks faster cuBLAS kernels: on an H100, 48,000 Whisper rows, 161 -> 139 us for out_proj,
    644 -> 573 us for fc1, 573 -> 506 us for fc2. Its consumers (add + LayerNorm, the GELU
    quantizer) read the product anyway and apply the scales in the same pass.

    The scalars are 1 / FP8_MAX each, so |out| <= K (the inputs' rows and the weight's rows
    are scaled to at most FP8_MAX): a 16-bit output cannot overflow, and it keeps 16-bit
    relative precision as the row-wise GEMM's output does."""

    out: torch.Tensor
    """[M, N], the model dtype: (x_q @ W_q^T) / FP8_MAX^2."""
    row_scale: torch.Tensor
    """[M] float32: the input's per-token scales."""
    col_scale: torch.Tensor
    """[N] float32: the weight's per-channel scales times FP8_MAX^2 (the GEMM's scalars undone,
    once per layer: the per-token scales go over as they are)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    def dequantize(self, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The Linear's output in the model dtype (with `bias`, as a GEMM epilogue adds it:
        in float32, one rounding): the reference of the consumers' fused kernels."""
        out = self.out.float() * self.row_scale[:, None] * self.col_scale[None, :]
        if bias is not None:
            out = out + bias.float()
        return out.to(self.out.dtype)


def fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """`quantize_activations` of x [..., K] as an `Fp8Rows`."""
    q, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
    return Fp8Rows(q.view(x.shape), scale.view(x.shape[:-1]), x.dtype)


def fp8_gemm_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """The exact product of the dequantized operands: x [M, K] (per-row scales) times
    weight [N, K]^T (per-row scales) in float32 -> [M, N]."""
    return (x_q.float() * x_scale[:, None]) @ (weight.float() * weight_scale[:, None]).T


def quantize_activations(
    x: torch.Tensor | Fp8Product, gelu: bool = False, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a Linear's input [M, K] (of GELU(x) with `gelu`): one Triton pass on
    CUDA (the same values: `v1/quantization/triton_quant.py`), the torch reference elsewhere.
    x may be the previous fp8 Linear's `Fp8Product`, `bias` that Linear's bias: both applied
    in the same pass (`Fp8Product.dequantize`).

    The GELU is the erf form, but on CUDA the tanh form, as the 16-bit path's GEMM epilogue
    computes it (`v1.models.layers.activation.linear_act`, the same `V1_GELU_EPILOGUE=0`
    switch keeps erf): erf on every element bounded the pass (48,000 x 5120 on an H100: 530 us
    for erf, 389 us for tanh, ~250 us for the bytes; whisper-large-v3-turbo fp8, 256 clips:
    4,925 against 4,801 RTFx). The two forms differ by at most 4.7e-4, far inside fp8's
    rounding step (~99.996% of the fp8 bytes equal either torch form's)."""
    scales = None
    if isinstance(x, Fp8Product):
        scales, x = (x.row_scale, x.col_scale), x.out
    if x.is_cuda and x.stride(-1) == 1:
        from v1 import envs
        from v1.quantization.triton_quant import quantize_rows_triton

        form = ("tanh" if envs.V1_GELU_EPILOGUE else "erf") if gelu else None
        return quantize_rows_triton(x, FP8_DTYPE, FP8_MAX, MIN_SCALE, form, bias, scales)
    if scales is not None:
        x = Fp8Product(x, *scales).dequantize(bias)
    elif bias is not None:
        x = x + bias
    return quantize_rows(torch.nn.functional.gelu(x) if gelu else x)
