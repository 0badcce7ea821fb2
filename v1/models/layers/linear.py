"""Linear layers whose parameters carry their own `weight_loader` (the nano-vllm convention);
fused layers (`QKVLinear`, `MergedColumnLinear`) take the unfused checkpoint tensors by shard id.
`shard_dim` says how tensor parallelism splits a layer (0: output rows, 1: input columns, None:
replicated), so the sharder (v1/distributed/tensor_parallel.py) works from outside the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from v1.models.checkpoint_slice import as_tensor


def default_weight_loader(param: torch.Tensor, loaded: Any) -> None:
    """Copy a checkpoint tensor (or a not yet read CheckpointSlice) into a parameter of the
    same shape (casting dtype/device)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.copy_(as_tensor(loaded))


class Linear(nn.Module):
    """y = x W^T + b, replicated. weight [output_size, input_size]. Quantization is applied from
    outside (v1/quantization): it sets `quant_method`, whose `apply(layer, x)` computes instead."""

    quantizable: ClassVar[bool] = True
    """How v1/quantization (which never imports the models) finds the layers it may quantize."""
    shard_dim: ClassVar[int | None] = None
    quant_method: Any = None
    tp: Any = None
    """The TensorParallelGroup once sharded (None: whole weights, no communication)."""
    unscaled_output: bool = False
    """An fp8 layer that returns an `Fp8Product` without its bias (set by its owner at load:
    `Fp8LinearMethod.set_unscaled_output`)."""
    lora: Any = None
    """Multi-LoRA, applied from outside (v1/lora): its `apply(x, out)` adds each token's
    adapter product to the layer's output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Values come from the checkpoint; the loader fails on anything left unloaded.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        out = F.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnLinear(Linear):
    """Output features split across ranks under tensor parallelism."""

    shard_dim = 0


class RowLinear(Linear):
    """Input features split across ranks under tensor parallelism (followed by an all-reduce).
    Sharded, only rank 0 holds the bias (the others zeros), so the sum adds it once."""

    shard_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [T, out]: this rank's partial sum when sharded
        return out if self.tp is None else self.tp.all_reduce(out)


class MergedColumnLinear(ColumnLinear):
    """Several column linears of one input fused along the output (e.g. gate_up_proj).

    Checkpoint shard `i` fills rows [sum(output_sizes[:i]), sum(output_sizes[:i+1]))."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        start = sum(self.output_sizes[:shard_id])
        return start, self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            default_weight_loader(param, loaded)
            return
        start, size = self.shard_range(shard_id)  # type: ignore[arg-type]
        default_weight_loader(param.narrow(0, start, size), loaded)


class QKVLinear(MergedColumnLinear):
    """Fused q/k/v projection: rows [q: H*D | k: Hkv*D | v: Hkv*D]; shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.head_size = head_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

    @property
    def q_size(self) -> int:
        return self.output_sizes[0]

    @property
    def kv_size(self) -> int:
        return self.output_sizes[1]

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        return super().shard_range(index)
