"""Activations by their Hugging Face config names, and SiluAndMul for fused gate_up outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [..., 2*I] = [gate | up] -> silu(gate) * up [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GELU(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {
    "gelu": lambda: GELU(),
    # gelu_new, gelu_fast and gelu_pytorch_tanh are all the tanh approximation.
    "gelu_new": lambda: GELU("tanh"),
    "gelu_fast": lambda: GELU("tanh"),
    "gelu_pytorch_tanh": lambda: GELU("tanh"),
    "quick_gelu": QuickGELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "tanh": nn.Tanh,
}


def get_act_fn(name: str) -> nn.Module:
    """The activation a Hugging Face config names (`hidden_act`, `activation_function`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
