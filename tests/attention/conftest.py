"""The `backend` fixture every attention test is parametrized over, and the output check.

A backend joins the suite by adding its name to BACKEND_NAMES (and to CUDA_ONLY if it needs
CUDA); it is skipped where its module cannot be imported or CUDA is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from shapes import Batch

from v1.attention.backend import AttentionBackend
from v1.attention.selector import load_backend

BACKEND_NAMES = ["torch_sdpa"]
CUDA_ONLY = {"triton", "flash_attn"}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class LoadedBackend:
    cls: type[AttentionBackend]
    device: torch.device


@pytest.fixture(
    params=[
        pytest.param(name, marks=[pytest.mark.gpu] if name in CUDA_ONLY else [])
        for name in BACKEND_NAMES
    ]
)
def backend(request: pytest.FixtureRequest) -> LoadedBackend:
    name = request.param
    if name in CUDA_ONLY and not torch.cuda.is_available():
        pytest.skip(f"{name} needs CUDA")
    try:
        cls = load_backend(name)
    except ImportError as e:
        pytest.skip(f"{name} cannot be imported: {e}")
    return LoadedBackend(cls, torch.device("cuda" if name in CUDA_ONLY else "cpu"))


def assert_output(out: torch.Tensor, batch: Batch, expected: torch.Tensor) -> None:
    """out [T_padded, H, D] equals expected on the real tokens; padding rows stay in the output
    because the layer reshapes to the padded token count."""
    assert out.shape == batch.query.shape
    tol = TOLERANCE[batch.query.dtype]
    num_tokens = batch.shape.num_tokens
    torch.testing.assert_close(out[:num_tokens], expected, atol=tol, rtol=tol)
