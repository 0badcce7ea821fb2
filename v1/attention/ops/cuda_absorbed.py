"""CUDA kernel of absorbed cross-attention (`absorbed_attention.cu`), compiled at run time by
NVRTC through `torch.cuda._compile_kernel`: no build step and no compiler on the user's machine
beyond the NVRTC library CUDA builds of torch ship.

It computes what `triton_absorbed.attend_encoder_states_triton` computes (the torch reference is
`absorbed_cross_attention.attend_encoder_states_torch`) for 16-bit encoder states: each warp
streams its own column slice of E through shared memory once per 16-row tile and uses it for
both products, where the Triton kernel loads every E tile twice. fp8 states, fp32 models,
widths it cannot slice and GPUs without mma.sync (sm_80+) stay on the Triton kernel;
`V1_ABSORBED_KERNEL=triton` forces it everywhere.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from v1.logger import init_logger

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("absorbed_attention.cu")
KERNEL_ENV = "V1_ABSORBED_KERNEL"
"""`cuda` (the default where it applies) or `triton`."""
MAX_WARP_COLUMNS = 160
"""Columns of d a warp owns at most: 40 registers of q' and 80 of accumulators a thread."""
BLOCK_N, MAX_STAGES = 32, 4
"""Encoder positions a step and cp.async stages at most (more stages where shared memory lets)."""


@dataclass(frozen=True)
class KernelConfig:
    """The compile-time shape of one kernel build (the .cu file's macros)."""

    bf16: bool
    warps: int
    warp_columns: int
    block_n: int
    stages: int
    span: int
    rows_per_half: int

    @property
    def smem_bytes(self) -> int:
        """E stages (16-byte padded rows) + two buffers of partial and summed scores."""
        stages = self.warps * self.stages * self.block_n * (self.warp_columns + 8) * 2
        scores = 2 * (self.warps + 1) * self.block_n * 16 * 4
        return stages + scores

    def source(self) -> str:
        macros = {
            "BF16": int(self.bf16),
            "NW": self.warps,
            "DW": self.warp_columns,
            "BN": self.block_n,
            "STAGES": self.stages,
            "SPAN": self.span,
            "RPH": self.rows_per_half,
        }
        return "".join(f"#define {k} {v}\n" for k, v in macros.items()) + SOURCE.read_text()


def warps_for(d_model: int) -> int | None:
    """Warps that split d into equal slices of whole 16-column k-steps, at most
    MAX_WARP_COLUMNS each; at least 4 where d allows (None: the kernel cannot take d)."""
    if d_model % 16:
        return None
    steps = d_model // 16
    least = max(-(-d_model // MAX_WARP_COLUMNS), min(steps, 4))
    for warps in range(least, 17):
        if steps % warps == 0:
            return warps
    return None


def plan(
    d_model: int,
    dtype: torch.dtype,
    span: int,
    rows_per_half: int,
    smem_limit: int,
    block_n: int = BLOCK_N,
    stages: int | None = None,
) -> KernelConfig | None:
    """The build for these states, with the most stages (2 to MAX_STAGES) that fit
    `smem_limit`, or the given count; None where nothing fits."""
    warps = warps_for(d_model)
    if warps is None or dtype not in (torch.float16, torch.bfloat16) or block_n not in (16, 32):
        return None
    counts = [stages] if stages is not None else range(MAX_STAGES, 1, -1)
    for count in counts:
        config = KernelConfig(
            dtype == torch.bfloat16, warps, d_model // warps, block_n, count, span, rows_per_half
        )
        if config.smem_bytes <= smem_limit:
            return config
    return None


def kernel_for(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    block_n: int = BLOCK_N,
    stages: int | None = None,
) -> tuple[KernelConfig, Any] | None:
    """(config, kernel) where the CUDA kernel takes these inputs, else None."""
    if (
        os.environ.get(KERNEL_ENV, "cuda") != "cuda"
        or not q_abs.is_cuda
        or scales is not None
        or states.dtype != q_abs.dtype
    ):
        return None
    device = q_abs.device.index if q_abs.device.index is not None else torch.cuda.current_device()
    shape = (q_abs.shape[2], states.shape[0], states.shape[3])
    return _build(device, q_abs.dtype, *shape, block_n, stages)


@functools.cache
def _build(
    device: int,
    dtype: torch.dtype,
    d_model: int,
    span: int,
    rows_per_half: int,
    block_n: int,
    stages: int | None,
) -> tuple[KernelConfig, Any] | None:
    """Plan and compile once per device and shape; None (logged) where NVRTC or the driver
    refuses the kernel, so the caller keeps the Triton kernel."""
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) < (8, 0) or not hasattr(torch.cuda, "_compile_kernel"):
        return None
    smem_limit = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    config = plan(d_model, dtype, span, rows_per_half, smem_limit, block_n, stages)
    if config is None:
        return None
    try:
        with torch.cuda.device(device):
            kernel = torch.cuda._compile_kernel(config.source(), "absorbed_attention_kernel")
            kernel.set_shared_memory_config(config.smem_bytes)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the Triton kernel
        logger.warning("absorbed CUDA kernel unavailable (%s); using the Triton kernel", exc)
        return None
    return config, kernel


def _split64(value: int) -> list[int]:
    """An int64 stride as the kernel's (lo, hi) int32 pair (the launcher passes C ints)."""
    lo = value & 0xFFFFFFFF
    return [lo - (1 << 32) if lo >= 1 << 31 else lo, value >> 32]


def attend_encoder_states_cuda(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    metadata: Any,
    config: KernelConfig,
    kernel: Any,
) -> torch.Tensor:
    """q' [T, H, d] (scale folded in) over each request's 16-bit encoder states -> context
    [T, H, d]; `metadata` is the Triton backend's (work items of `block_m` query rows)."""
    common = metadata.common
    num_heads = q_abs.shape[1]
    assert q_abs.stride(2) == 1 and states.stride(4) == 1
    out = torch.zeros_like(q_abs)
    work_req, work_mblock = metadata.work
    if work_req.numel() == 0:
        return out
    num_tiles = -(-metadata.block_m * num_heads // 16)
    kernel(
        grid=(work_req.numel() * num_tiles, 1, 1),
        block=(config.warps * 32, 1, 1),
        args=[
            q_abs,
            states,
            out,
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
            work_req,
            work_mblock,
            q_abs.stride(0),
            q_abs.stride(1),
            out.stride(0),
            out.stride(1),
            *_split64(states.stride(0)),
            *_split64(states.stride(1)),
            *_split64(states.stride(2)),
            states.stride(3),
            common.block_table.stride(0),
            num_heads,
            metadata.block_m,
            num_tiles,
        ],
        shared_mem=config.smem_bytes,
    )
    return out
