"""Set-up of the multi-GPU tests: token identity with one GPU is checked in IEEE fp32."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def ieee_fp32() -> Iterator[None]:
    """No TF32 matmuls while a test runs (restored after)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
