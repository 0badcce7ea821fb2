"""Checkpoints already in fp8 (compressed-tensors, or a `quantization_config` with quant_method
"fp8"): per-tensor, per-channel or block-wise weight scales, dequantized as read and quantized
again per channel after loading (`Fp8CheckpointReader`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from v1.logger import init_logger
from v1.quantization.fp8 import linear_layers, quantize_model_fp8
from v1.quantization.fp8_rows import FP8_DTYPE

logger = init_logger(__name__)

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
        for _, module in linear_layers(model):
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
