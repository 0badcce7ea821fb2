"""CUDA kernel of absorbed cross-attention (`absorbed_attention.cu`), compiled at run time by
NVRTC (no build step, no CUDA_HOME): what `triton_absorbed` computes, for 16-bit models over
16-bit or fp8 states, each warp streaming its column slice of E once per row tile. fp32 models,
widths it cannot slice, pre-sm_80 GPUs and fp8 states below sm_89 stay on the Triton kernel;
`V1_ABSORBED_KERNEL=triton` forces it everywhere (torch reference: absorbed_cross_attention).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from v1 import envs
from v1.logger import init_logger

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("absorbed_attention.cu")
KERNEL_NAME = "absorbed_attention_kernel"
KERNEL_ENV = envs.ABSORBED_KERNEL_ENV
"""`cuda` (the default where it applies) or `triton` (the config's cross-attention rule reads it)."""
MAX_WARP_COLUMNS = 160
"""Columns of d a warp owns at most: 80 accumulator registers a thread per 16-row tile."""
STEP_SHAPES = ((32, 2), (16, 2))
"""(encoder positions a step, cp.async stages) in order of preference, the first that fits
shared memory is built. Measured on an H100 at the large-v3 shape (256 requests, fp16): more
stages did not help (16 heads: 16 x 2 381 us, 16 x 3 389, 16 x 4 395; fp8 states, 20 heads:
16 x 2 551, 16 x 3 538); 32 positions a step beat 16 where both fit (the 16-row first version:
512 against 577 us)."""


@dataclass(frozen=True)
class KernelConfig:
    """The compile-time shape of one kernel build (the .cu file's macros)."""

    bf16: bool
    m_tiles: int
    """16-row tiles of (token, head) rows a block computes: 2 past 16 heads (Whisper's 20), so a
    decode step reads E once for all of a token's heads."""
    warps: int
    warp_columns: int
    block_n: int
    stages: int
    span: int
    rows_per_half: int
    fp8: bool = False
    """fp8 states: stages hold fp8 rows and their scales; the tensor cores read them there."""

    @property
    def smem_bytes(self) -> int:
        """E stages and q' (16-byte padded rows) + partial and summed scores (the .cu file's
        layout)."""
        raw_row = self.warp_columns * (1 if self.fp8 else 2) + 16
        stages = self.warps * self.stages * self.block_n * raw_row
        if self.fp8:
            stages += self.warps * self.stages * self.block_n * 4
        rows = 16 * self.m_tiles
        queries = rows * (self.warps * self.warp_columns + 8) * 2
        scores = (self.warps + 1) * self.block_n * rows * 4
        return stages + queries + scores

    def source(self) -> str:
        macros = {
            "BF16": int(self.bf16),
            "M_TILES": self.m_tiles,
            "NW": self.warps,
            "DW": self.warp_columns,
            "BN": self.block_n,
            "STAGES": self.stages,
            "SPAN": self.span,
            "RPH": self.rows_per_half,
            "FP8": int(self.fp8),
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
    num_heads: int,
    smem_limit: int,
    step_shape: tuple[int, int] | None = None,
    fp8: bool = False,
) -> KernelConfig | None:
    """The build for these states (16-bit, or fp8 with `fp8`) and heads (the rows of one query
    token): the first of STEP_SHAPES (or the given one) that fits `smem_limit`; None where
    nothing fits."""
    warps = warps_for(d_model)
    if warps is None or dtype not in (torch.float16, torch.bfloat16):
        return None
    m_tiles = 2 if num_heads > 16 else 1
    for block_n, stages in [step_shape] if step_shape else STEP_SHAPES:
        config = KernelConfig(
            dtype == torch.bfloat16,
            m_tiles,
            warps,
            d_model // warps,
            block_n,
            stages,
            span,
            rows_per_half,
            fp8,
        )
        if block_n in (16, 32) and stages >= 2 and config.smem_bytes <= smem_limit:
            return config
    return None


def kernel_for(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    step_shape: tuple[int, int] | None = None,
) -> tuple[KernelConfig, Any] | None:
    """(config, kernel) where the CUDA kernel takes these inputs, else None."""
    fp8 = states.dtype == torch.float8_e4m3fn and scales is not None
    if (
        envs.absorbed_kernel() != "cuda"
        or not q_abs.is_cuda
        or (states.dtype != q_abs.dtype and not fp8)
        or (fp8 and (scales.stride(3) != 1 or scales.dtype != torch.float32))
        or q_abs.data_ptr() % 16
        or q_abs.stride(0) % 8
        or q_abs.stride(1) % 8
    ):
        return None
    device = q_abs.device.index if q_abs.device.index is not None else torch.cuda.current_device()
    shape = (q_abs.shape[2], states.shape[0], states.shape[3], q_abs.shape[1])
    return _build(device, q_abs.dtype, *shape, step_shape, fp8)


@functools.cache
def _build(
    device: int,
    dtype: torch.dtype,
    d_model: int,
    span: int,
    rows_per_half: int,
    num_heads: int,
    step_shape: tuple[int, int] | None,
    fp8: bool,
) -> tuple[KernelConfig, Any] | None:
    """Plan and compile once per device and shape; None (logged) where NVRTC or the driver
    refuses the kernel, so the caller keeps the Triton kernel."""
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) < ((8, 9) if fp8 else (8, 0)):  # fp8 conversions: sm_89
        return None
    smem_limit = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    config = plan(d_model, dtype, span, rows_per_half, num_heads, smem_limit, step_shape, fp8)
    if config is None:
        return None
    try:
        from torch.cuda._utils import _cuda_load_module

        cubin = nvrtc_cubin(config.source(), KERNEL_NAME, f"{props.major}{props.minor}")
        with torch.cuda.device(device):
            kernel = _cuda_load_module(cubin, [KERNEL_NAME])[KERNEL_NAME]
            kernel.set_shared_memory_config(config.smem_bytes)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the Triton kernel
        logger.warning("absorbed CUDA kernel unavailable (%s); using the Triton kernel", exc)
        return None
    return config, kernel


def nvrtc_cubin(source: str, name: str, arch: str) -> bytes:
    """NVRTC compiles `source` (no #include) for sm_`arch` to a cubin; its log on failure."""
    from torch.cuda._utils import _get_gpu_rtc_library

    nvrtc = _get_gpu_rtc_library()

    def check(result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NVRTC error {result}")

    prog = ctypes.c_void_p()
    check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
        )
    )
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
        array = (ctypes.c_char_p * len(options))(*options)
        if nvrtc.nvrtcCompileProgram(prog, len(options), array) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode()}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _split64(value: int) -> list[int]:
    """An int64 stride as the kernel's (lo, hi) int32 pair (the launcher passes C ints)."""
    lo = value & 0xFFFFFFFF
    return [lo - (1 << 32) if lo >= 1 << 31 else lo, value >> 32]


def _grid_tiles(metadata: Any, num_heads: int, tile_rows: int) -> int:
    """Blocks a work item gets: one per row tile of the step's longest query block, or one in
    all while a CUDA graph is captured. A graph's metadata allows 16 query tokens a request
    (the rows are known on the device only), and a block needs most of an SM's shared memory, so
    the 9 empty blocks per request of a one-token replay would each hold an SM while they exit;
    one block loops over the item's tiles instead."""
    if torch.cuda.is_current_stream_capturing():
        return 1
    rows = min(metadata.block_m, metadata.common.max_query_len) * num_heads
    return max(1, -(-rows // tile_rows))


def attend_encoder_states_cuda(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    metadata: Any,
    config: KernelConfig,
    kernel: Any,
) -> torch.Tensor:
    """q' [T, H, d] (scale folded in) over each request's encoder states (16-bit, or fp8 with
    `scales`) -> context [T, H, d]; `metadata` is the Triton backend's (work items of
    `block_m` query rows)."""
    common = metadata.common
    num_heads = q_abs.shape[1]
    assert q_abs.stride(2) == 1 and states.stride(4) == 1
    out = torch.zeros_like(q_abs)
    work_req, work_mblock = metadata.work
    if work_req.numel() == 0:
        return out
    grid_tiles = _grid_tiles(metadata, num_heads, 16 * config.m_tiles)
    kernel(
        grid=(work_req.numel() * grid_tiles, 1, 1),
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
            scales if config.fp8 else q_abs,  # an unused pointer without fp8
            *_split64(scales.stride(0) if config.fp8 else 0),
            *_split64(scales.stride(1) if config.fp8 else 0),
            *_split64(scales.stride(2) if config.fp8 else 0),
            common.block_table.stride(0),
            num_heads,
            metadata.block_m,
            grid_tiles,
        ],
        shared_mem=config.smem_bytes,
    )
    return out
