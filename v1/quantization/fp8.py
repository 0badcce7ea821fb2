"""FP8 Linear layers: `quantize_model_fp8` turns the Linear layers of a loaded model (but those a
recipe keeps, fp8_recipes.py) into weight float8_e4m3fn [N, K] with per-channel scales; each call
quantizes its input per token and runs `torch._scaled_mm` on sm89+ GPUs, else the exact
dequantizing reference. Layers are found by duck typing (`quantizable`): no v1.models import.
"""

from __future__ import annotations

import torch
from torch import nn

from v1.logger import init_logger
from v1.quantization.fp8_rows import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Product,
    Fp8Rows,
    fp8_gemm_reference,
    quantize_activations,
    quantize_rows,
)

logger = init_logger(__name__)


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every Linear fp8 may quantize: the modules whose class sets
    `quantizable` (v1.models.layers.linear.Linear; not LM heads, embeddings, convolutions)."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "quantizable", False)]


def is_fp8_linear(layer: nn.Module) -> bool:
    """Whether `layer` computes in fp8 (takes `Fp8Rows` inputs)."""
    return isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod)


def link_fp8_norms(model: nn.Module) -> int:
    """After quantizing: let every module that knows which norms feed which Linears (a
    `link_fp8_norms` method, e.g. a pre-norm encoder layer) mark the norms whose consumers
    are all fp8; returns how many norms hand over `Fp8Rows`."""
    for module in model.modules():
        link = getattr(module, "link_fp8_norms", None)
        if link is not None:
            link()
    return sum(bool(getattr(m, "fp8_output", False)) for m in model.modules())


# ---- GEMMs ----


def _scaled_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: per token (A) and per output channel (B), and
    the bias added in its epilogue when given."""
    return torch._scaled_mm(
        x_q,
        weight.t(),  # [K, N] column-major, as _scaled_mm wants its second operand
        scale_a=x_scale[:, None].contiguous(),
        scale_b=weight_scale[None, :].contiguous(),
        bias=bias,
        out_dtype=out_dtype,
    )


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """The scalar scale 1 / FP8_MAX of an `Fp8Product` GEMM's operands (one tensor per device,
    made outside graph capture at the first eager call)."""
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        unit = _UNIT_SCALES[device] = torch.tensor(1.0 / FP8_MAX, device=device)
    return unit


_SCALED_MM_BIAS: dict[tuple[int, torch.dtype], bool] = {}


def scaled_mm_takes_bias(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether row-wise `torch._scaled_mm` adds an `out_dtype` bias on this GPU (probed once,
    at model load)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, out_dtype)
    if key not in _SCALED_MM_BIAS:
        a = torch.ones(16, 32, device=device).to(FP8_DTYPE)
        scale = torch.ones(16, device=device)
        try:
            out = _scaled_mm(
                a, scale, a, scale, out_dtype, torch.ones(16, device=device, dtype=out_dtype)
            )
            _SCALED_MM_BIAS[key] = bool((out == 33).all())
        except RuntimeError as e:
            logger.info("row-wise _scaled_mm with a bias unavailable: %s", e)
            _SCALED_MM_BIAS[key] = False
    return _SCALED_MM_BIAS[key]


_SCALED_MM_OUT: dict[tuple[int, torch.dtype], torch.dtype | None] = {}


def scaled_mm_out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The output dtype row-wise `torch._scaled_mm` gives on this GPU for a `dtype` model (some
    builds produce bfloat16 only), or None where it cannot run (no CUDA, before sm89). Probed
    once per device and dtype, outside any CUDA graph capture (at model load)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, dtype)
    if key not in _SCALED_MM_OUT:
        _SCALED_MM_OUT[key] = None
        if torch.cuda.get_device_capability(index) >= (8, 9):
            a = torch.ones(16, 32, device=device).to(FP8_DTYPE)
            scale = torch.ones(16, device=device)
            for out_dtype in dict.fromkeys((dtype, torch.bfloat16)):
                try:
                    _scaled_mm(a, scale, a, scale, out_dtype)
                except RuntimeError as e:
                    logger.info("row-wise _scaled_mm to %s unavailable: %s", out_dtype, e)
                    continue
                _SCALED_MM_OUT[key] = out_dtype
                break
    return _SCALED_MM_OUT[key]


class Fp8LinearMethod:
    """What an fp8 `Linear` computes: y = dequant(quant(x)) dequant(W)^T + b, per-token
    activation scales and per-channel weight scales."""

    fuses_input_gelu = True
    """`apply(..., gelu=True)` computes layer(GELU(x)) (see `v1.models.layers.activation`)."""

    def __init__(self, scaled_mm_out: torch.dtype | None, fused_bias: bool = False) -> None:
        self.scaled_mm_out = scaled_mm_out
        """Output dtype of the GPU GEMM (None: the reference GEMM)."""
        self.fused_bias = fused_bias
        """The GPU GEMM adds the bias (in the model dtype, equal to the GEMM's output dtype)."""
        self._dequantized: dict[int, torch.Tensor] = {}
        """CPU only: id(layer) -> its dequantized float32 weight (the reference's right operand
        does not change, and recomputing it every call makes CPU tests slow)."""

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor | Fp8Rows | Fp8Product,
        gelu: bool = False,
        input_bias: torch.Tensor | None = None,
    ) -> torch.Tensor | Fp8Product:
        """layer(x), or layer(GELU(x)) with `gelu` (an MLP's activation fused into this
        layer's input quantizer); x may come quantized already (`Fp8Rows`), or as the previous
        fp8 Linear's `Fp8Product` with that Linear's bias in `input_bias`. An
        `unscaled_output` layer returns an `Fp8Product` without its bias."""
        if isinstance(x, Fp8Rows):
            assert not gelu
            shape, dtype, on_gpu = x.q.shape, x.dtype, x.q.is_cuda
            x_q, x_scale = x.q.reshape(-1, shape[-1]), x.scale.reshape(-1)
        elif isinstance(x, Fp8Product):
            shape, dtype, on_gpu = x.out.shape, x.out.dtype, x.out.is_cuda
            x_q, x_scale = quantize_activations(x, gelu, input_bias)
        else:
            shape, dtype, on_gpu = x.shape, x.dtype, x.is_cuda
            x_q, x_scale = quantize_activations(x.reshape(-1, shape[-1]), gelu)  # [M, K], [M]
        weight, weight_scale = layer.weight, layer.weight_scale
        n, k = weight.shape
        bias = layer.bias
        if layer.unscaled_output:
            assert on_gpu and len(shape) == 2, shape
            return self._product(x_q, x_scale, layer, dtype)
        if self.scaled_mm_out is not None and on_gpu and n % 16 == 0 and k % 16 == 0:
            fuse = self.fused_bias and bias is not None and bias.dtype == self.scaled_mm_out
            out = _scaled_mm(
                x_q, x_scale, weight, weight_scale, self.scaled_mm_out, bias if fuse else None
            )
            if fuse:
                bias = None
        elif on_gpu:
            out = fp8_gemm_reference(x_q, x_scale, weight, weight_scale)
        else:
            w = self._dequantized.get(id(layer))
            if w is None:
                w = self._dequantized[id(layer)] = weight.float() * weight_scale[:, None]
            out = (x_q.float() * x_scale[:, None]) @ w.T
        out = out.to(dtype)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], n)

    def set_unscaled_output(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        """Make `layer` hand its output over as an `Fp8Product` (bias not added) where it can:
        the GPU GEMM runs and writes `dtype` (the model's 16-bit dtype), the shapes suit it and
        the layer is not sharded (a sharded layer's partial sums have their own row scales).
        Returns whether it does; its owner then adds the bias and scales (at model load)."""
        n, k = layer.weight.shape
        layer.unscaled_output = (
            self.scaled_mm_out == dtype
            and dtype in (torch.float16, torch.bfloat16)
            and layer.weight.is_cuda
            and n % 16 == 0
            and k % 16 == 0
            and layer.tp is None
        )
        if layer.unscaled_output:
            layer.col_scale = layer.weight_scale.float() * FP8_MAX**2
            _unit_scale(layer.weight.device)
        return layer.unscaled_output

    def _product(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: nn.Module, dtype: torch.dtype
    ) -> Fp8Product:
        unit = _unit_scale(x_q.device)
        out = torch._scaled_mm(
            x_q, layer.weight.t(), scale_a=unit, scale_b=unit, out_dtype=dtype
        )  # tensor-wise: out = x_q @ W_q^T / FP8_MAX^2
        return Fp8Product(out, x_scale, layer.col_scale)


def quantize_linear_(layer: nn.Module, method: Fp8LinearMethod) -> None:
    """Replace a loaded Linear's weight by fp8 [N, K] and per-channel `weight_scale` [N]."""
    weight, weight_scale = quantize_rows(layer.weight.data)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
    layer.quant_method = method


def quantize_model_fp8(model: nn.Module, skip: set[str] | frozenset[str] = frozenset()) -> int:
    """Quantize every `Linear` of a loaded model (but the module names in `skip`) in place;
    returns how many."""
    linears = linear_layers(model)
    layers = [(name, m) for name, m in linears if name not in skip]
    if not layers:
        return 0
    param = layers[0][1].weight
    out_dtype = scaled_mm_out_dtype(param.device, param.dtype)
    fused_bias = out_dtype == param.dtype and scaled_mm_takes_bias(param.device, out_dtype)
    method = Fp8LinearMethod(out_dtype, fused_bias)
    for _, layer in layers:
        quantize_linear_(layer, method)
    linked = link_fp8_norms(model)
    unscaled = sum(layer.unscaled_output for _, layer in layers)
    kept = [name for name, _ in linears if name in skip]
    logger.info(
        "fp8: %d of %d Linear layers quantized (%s GEMM; %d norms quantize their output; %d "
        "Linears hand over unscaled products); kept in %s: %s",
        len(layers),
        len(linears),
        "torch._scaled_mm" if method.scaled_mm_out is not None else "dequantize reference",
        linked,
        unscaled,
        param.dtype,
        _abbreviate(kept) if kept else "none",
    )
    return len(layers)


def _abbreviate(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
