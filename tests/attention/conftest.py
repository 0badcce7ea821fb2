"""The `backend` fixture every attention test is parametrized over.

A backend joins the suite by adding its name to BACKEND_NAMES (and to CUDA_ONLY if it needs
CUDA); it is skipped where its module cannot be imported or CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch
from shapes import LoadedBackend

from v1.attention.selector import load_backend

BACKEND_NAMES = ["torch_sdpa", "triton", "flash_attn"]
CUDA_ONLY = {"triton", "flash_attn"}


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
