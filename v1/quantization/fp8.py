"""FP8 (float8_e4m3fn): the row quantizer, fp8 Linear layers and fp8 checkpoints.

`quantize_rows` is the one quantizer of the engine, one float32 scale per row of the last
dimension: Linear weights (a row = an output channel), activations (a row = a token), cached K/V
(a row = one head of one token) and encoder states (a row = one encoder position).

`quantize_model_fp8` turns the `Linear` layers of a loaded model (all but those a recipe keeps,
fp8_recipes.py) into fp8 layers: weight float8_e4m3fn [N, K] with per-output-channel scales [N];
each call quantizes its input per token and multiplies with `torch._scaled_mm` on sm89+ GPUs, or
with the exact dequantize-then-matmul reference (CPU, and GPUs or shapes _scaled_mm cannot
serve). LM heads, embeddings and convolutions keep the model dtype. `Fp8CheckpointReader` loads
checkpoints already in fp8 (compressed-tensors, or a `quantization_config` with quant_method
"fp8"): per-tensor, per-channel or block-wise scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from v1.logger import init_logger

logger = init_logger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12
"""Scale of an all-zero row (any positive value dequantizes it to zeros)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (fp8 [..., n], float32 scales [...]) with x ~= q * scale[..., None]; each
    row's largest magnitude maps to the fp8 maximum (448)."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
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


def is_fp8_linear(layer: nn.Module) -> bool:
    """Whether `layer` computes in fp8 (takes `Fp8Rows` inputs)."""
    return isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod)


def link_fp8_norms(model: nn.Module) -> int:
    """After quantizing: let every module that knows which norms feed which Linears (a
    `link_fp8_norms` method, e.g. a pre-norm encoder layer) mark the norms whose consumers
    are all fp8; returns how many norms hand over `Fp8Rows`."""
    from v1.models.layers.norm import LayerNorm

    for module in model.modules():
        link = getattr(module, "link_fp8_norms", None)
        if link is not None:
            link()
    return sum(isinstance(m, LayerNorm) and m.fp8_output for m in model.modules())


# ---- GEMMs ----


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
        return quantize_rows_triton(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE, form, bias, scales)
    if scales is not None:
        x = Fp8Product(x, *scales).dequantize(bias)
    elif bias is not None:
        x = x + bias
    return quantize_rows(torch.nn.functional.gelu(x) if gelu else x)


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
    from v1.models.layers.linear import Linear

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
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


# ---- checkpoints already in fp8 ----

_DYNAMIC_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale")
"""Static activation / KV scales of some fp8 checkpoints: the engine scales per token instead."""
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """The fp8 `quantization_config` of a checkpoint."""

    quant_method: str
    weight_block_size: tuple[int, int] | None = None
    """Block-wise weight scales [ceil(N / bn), ceil(K / bk)] (else per tensor or channel)."""

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Fp8CheckpointConfig | None:
        """None when the checkpoint is not quantized; ValueError when it is quantized in a way
        the engine cannot read."""
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            return None
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            return cls("fp8", tuple(block) if block else None)
        if method == "compressed-tensors":
            _check_compressed_tensors(qc)
            return cls("compressed-tensors")
        raise ValueError(
            f"unsupported checkpoint quantization {method!r}: fp8 checkpoints (quant_method "
            "'fp8' or 'compressed-tensors' float8) load; others do not"
        )


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
            raise ValueError(
                f"compressed-tensors group {name!r} quantizes weights to "
                f"{weights.get('num_bits')}-bit {weights.get('type')}: only 8-bit float (fp8) "
                "checkpoints load"
            )
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(
                f"compressed-tensors group {name!r}: fp8 weight strategy "
                f"{weights.get('strategy')!r} is not supported (tensor, channel or block)"
            )


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None
) -> torch.Tensor:
    """An fp8 checkpoint weight [N, K] and its scale (per tensor [] or [1], per channel [N] or
    [N, 1], or per block [ceil(N / bn), ceil(K / bk)]) -> float32 [N, K]."""
    n, k = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        return weight.float() * scale.reshape(())
    if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
        return weight.float() * scale.reshape(n, 1)
    if scale.dim() == 2:
        bn = block_size[0] if block_size else -(-n // scale.shape[0])
        bk = block_size[1] if block_size else -(-k // scale.shape[1])
        if scale.shape == (-(-n // bn), -(-k // bk)):
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            return weight.float() * full
    raise ValueError(
        f"cannot read an fp8 weight {tuple(weight.shape)} with a scale of shape "
        f"{tuple(scale.shape)}"
    )


class Fp8CheckpointReader:
    """Reads an fp8 checkpoint's tensors into a model built in its high-precision dtype: each
    fp8 `*.weight` is dequantized with its `*.weight_scale` (or `*.weight_scale_inv`) and
    marked, static activation/KV scales are dropped. After loading, `quantize_loaded` quantizes
    (per channel) every Linear whose weight came only from fp8 tensors: layers the checkpoint
    kept in high precision (its ignore list) stay so."""

    MARK = "_v1_from_fp8"

    def __init__(self, config: Fp8CheckpointConfig) -> None:
        self.config = config
        self._loads: dict[int, list[bool]] = {}
        """id(Linear) -> per loaded weight tensor: did it come from fp8?"""
        self._linears: list[nn.Module] = []

    def read(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        pending_weights: dict[str, torch.Tensor] = {}
        pending_scales: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name.endswith(_DYNAMIC_SCALE_SUFFIXES):
                continue
            scale_suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
            if scale_suffix is not None:
                base = name.removesuffix(scale_suffix)
                if base in pending_weights:
                    yield self._dequantized(base, pending_weights.pop(base), tensor)
                else:
                    pending_scales[base] = tensor
            elif name.endswith(".weight") and tensor.dtype == FP8_DTYPE:
                base = name.removesuffix(".weight")
                if base in pending_scales:
                    yield self._dequantized(base, tensor, pending_scales.pop(base))
                else:
                    pending_weights[base] = tensor
            else:
                yield name, tensor
        if pending_weights or pending_scales:
            unpaired = sorted(pending_weights) + sorted(pending_scales)
            raise ValueError(f"fp8 weights and scales that do not pair up: {unpaired[:10]}")

    def _dequantized(
        self, base: str, weight: torch.Tensor, scale: torch.Tensor
    ) -> tuple[str, torch.Tensor]:
        tensor = dequantize_weight(weight, scale, self.config.weight_block_size)
        setattr(tensor, self.MARK, True)
        return f"{base}.weight", tensor

    def track(self, model: nn.Module) -> None:
        """Before loading: record, for every Linear, which of its weight tensors were fp8."""
        from v1.models.layers.linear import Linear

        for module in model.modules():
            if not isinstance(module, Linear):
                continue
            loads = self._loads.setdefault(id(module), [])
            self._linears.append(module)
            param = module.weight
            inner = param.weight_loader

            def loader(
                p: Any, loaded: torch.Tensor, *args: Any, _inner=inner, _loads=loads
            ) -> None:
                _loads.append(bool(getattr(loaded, Fp8CheckpointReader.MARK, False)))
                _inner(p, loaded, *args)

            param.weight_loader = loader

    def quantize_loaded(
        self, model: nn.Module, keep: set[str] | frozenset[str] = frozenset()
    ) -> int:
        """After loading: quantize the Linear layers loaded only from fp8 tensors, but those
        named in `keep` (the user's fp8_ignore: dequantized, they stay in the model dtype)."""
        skip = {
            name
            for name, module in model.named_modules()
            if id(module) in self._loads
            and not (self._loads[id(module)] and all(self._loads[id(module)]))
        }
        for module in self._linears:
            module.weight.weight_loader = module.weight_loader
        if skip:
            logger.info("fp8 checkpoint: %d Linear layers stay in high precision", len(skip))
        return quantize_model_fp8(model, skip | keep)
