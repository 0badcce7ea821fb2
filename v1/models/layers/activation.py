"""Activations by their Hugging Face config names, SiluAndMul for fused gate_up outputs, and
`linear_act`: a Linear followed by its activation, with GELU fused into the GEMM on CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from v1 import envs
from v1.models.layers.norm import use_fused_elementwise
from v1.quantization.fp8_rows import Fp8Product

if TYPE_CHECKING:
    from v1.models.layers.linear import Linear


class SiluAndMul(nn.Module):
    """x [..., 2*I] = [gate | up] -> silu(gate) * up [..., I]. One Triton kernel
    (`triton_activation.py`) under `use_fused_elementwise`; the torch path is its reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_elementwise(x):
            from v1.models.layers.triton_activation import silu_and_mul_triton

            return silu_and_mul_triton(x)
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


def linear_act(layer: Linear, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(layer(x)). On CUDA in 16 bits a GELU runs as the GEMM's epilogue (cuBLASLt
    GELU_BIAS through `torch._addmm_activation`): the [T, ffn] product is written once instead
    of written, read and written again (on an H100, Whisper's fc1 at 48,000 x 1280 -> 5120 took
    1,065 us against 1,306 us for the GEMM and a separate GELU).

    The epilogue computes the tanh form of GELU; for the erf form (`hidden_act="gelu"`) the two
    differ by at most 4.7e-4, about one 16-bit rounding step of the result (measured against
    the unfused path: within 0.004 at |y| < 8, the rounding of the GEMM output itself).
    `V1_GELU_EPILOGUE=0` turns it off; float32 and CPU always take the exact path."""
    if (
        layer.quant_method is None  # first: an fp8 layer's x may be `Fp8Rows`, not a tensor
        and layer.lora is None  # adapters add their product to layer(x), before act
        and isinstance(act, GELU)
        and envs.V1_GELU_EPILOGUE
        and x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.dim() == 2
        and layer.bias is not None
    ):
        return torch._addmm_activation(layer.bias, x, layer.weight.t(), use_gelu=True)
    return act(layer(x))


def fuses_input_gelu(fc2: Linear, act: nn.Module) -> bool:
    """Whether `gelu_mlp` runs act inside fc2's input quantizer: fc2 an fp8 layer (whole, not
    sharded: a sharded fc2 sums its partial outputs in its forward), act the exact GELU."""
    method = getattr(fc2, "quant_method", None)
    return (
        method is not None
        and isinstance(act, GELU)
        and act.approximate == "none"
        and fc2.tp is None
        and getattr(method, "fuses_input_gelu", False)
    )


def gelu_mlp(fc1: Linear, act: nn.Module, fc2: Linear, x: Any) -> Any:
    """fc2(act(fc1(x))), an MLP's two Linears. When fc2 is an fp8 layer and act the exact GELU,
    the activation runs inside fc2's input quantizer (one pass over the [T, ffn] product
    instead of an activation pass and a quantizer pass; fc1's bias and scales too when fc1
    hands over an `Fp8Product`); otherwise `linear_act` then fc2."""
    if fuses_input_gelu(fc2, act):
        h = fc1(x)
        bias = fc1.bias if isinstance(h, Fp8Product) else None
        return fc2.quant_method.apply(fc2, h, gelu=True, input_bias=bias)
    return fc2(linear_act(fc1, act, x))
