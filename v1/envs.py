"""Every environment variable the engine reads, in one place.

Each is read once, at import, with its default; its docstring says what it changes.
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


V1_CPU_KV_CACHE_BYTES: int = _int("V1_CPU_KV_CACHE_BYTES", 1 << 30)
"""KV cache bytes on CPU when no size is configured."""

V1_MULTIPROCESSING: bool = _bool("V1_MULTIPROCESSING", True)
"""Run the EngineCore in its own process (LLM and AsyncLLM); 0 keeps it in-process."""

V1_ENGINE_READY_TIMEOUT_S: int = _int("V1_ENGINE_READY_TIMEOUT_S", 600)
"""Seconds a client waits for the EngineCore process's ready handshake."""

V1_LOG_LEVEL: str = os.environ.get("V1_LOG_LEVEL", "INFO")
"""Logging level of the v1 logger."""

V1_MAX_AUDIO_SECONDS: int = _int("V1_MAX_AUDIO_SECONDS", 3 * 3600)
"""Longest decoded audio accepted, in seconds."""

V1_MAX_AUDIO_BYTES: int = _int("V1_MAX_AUDIO_BYTES", 100 << 20)
"""Largest encoded audio upload accepted, in bytes."""

V1_MAX_REQUEST_BYTES: int = _int("V1_MAX_REQUEST_BYTES", 32 << 20)
"""Largest JSON request body the API server accepts, in bytes (audio uploads: V1_MAX_AUDIO_BYTES)."""

V1_MAX_PENDING_REQUESTS: int = _int("V1_MAX_PENDING_REQUESTS", 1024)
"""Inference requests the API server holds at once; more are answered 503 (`--max-pending`)."""


PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess folder; `v1 serve --api-server-count` > 1 sets it."""


def prometheus_multiproc_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR as it is now (None when unset or empty): set at run time, by
    the first API server process, before its metrics exist."""
    return os.environ.get(PROMETHEUS_MULTIPROC_DIR) or None


def set_prometheus_multiproc_dir(folder: str) -> None:
    """Sets it for this process and the processes it starts."""
    os.environ[PROMETHEUS_MULTIPROC_DIR] = folder


def cuda_visible_devices() -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES list as it is now (None when unset). Read on each call, not at
    import: a data-parallel frontend gives each EngineCore a slice of it."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


V1_FUSED_ENCODER: bool = _bool("V1_FUSED_ENCODER", True)
"""On CUDA in 16 bits, an encoder-only step's embeddings (BERT family: gathers + adds +
LayerNorm) and its mean pooling (+ L2 normalize) run as one Triton kernel each
(v1/models/layers/triton_encoder.py); 0 keeps the torch paths, their references."""

V1_CUDNN_VARLEN: bool = _bool("V1_CUDNN_VARLEN", False)
"""Experimental: packed (varlen) bidirectional attention without a KV cache (BERT family)
through cuDNN's ragged fused attention instead of flash varlen, on CUDA in 16 bits; falls back
to flash varlen (logged) where cuDNN refuses. Off by default until measured on a GPU. With it,
encoder-only steps run eagerly (no CUDA graphs: the op cannot be stream-captured)."""

V1_TRITON_ENCODER_ONLY: bool = _bool("V1_TRITON_ENCODER_ONLY", True)
"""Encoder-only attention (BERT family) of head size 32 or 64 over inputs of at most 2,048
tokens, on CUDA in 16 bits, through the Triton kernel of
v1/attention/ops/triton_encoder_attention.py (bert-base's attention 58 against 93 ms in aten's
flash varlen, H200); 0 keeps aten's flash varlen. V1_CUDNN_VARLEN, where set, takes
precedence."""

V1_FA4: str = os.environ.get("V1_FA4", "auto").strip().lower() or "auto"
"""FlashAttention-4 (the optional `flash-attn-4` package) for equal-length encoder batches of
8+ sequences (Whisper's windows), on CUDA in 16 bits, where it is installed: "auto" on Hopper
(compute capability 9.x), "1" on any GPU the package supports, "0" never (cuDNN attention; see
v1/attention/ops/fa4.py)."""

V1_GELU_EPILOGUE: bool = _bool("V1_GELU_EPILOGUE", True)
"""On CUDA in 16 bits, run a Linear's GELU as its GEMM's epilogue (tanh form; see
v1/models/layers/activation.py); 0 keeps the separate exact activation."""


def sampler_graphs() -> bool | None:
    """V1_SAMPLER_GRAPHS, read when a model state is built: 0 keeps every step on the general
    Sampler; 1 runs the fixed-shape sampler (v1/sample/graphed.py) also off CUDA, eagerly (the
    CPU tests compare the two); unset: the fixed-shape sampler's CUDA graphs on CUDA."""
    value = os.environ.get("V1_SAMPLER_GRAPHS")
    if value is None or value == "":
        return None
    return _bool("V1_SAMPLER_GRAPHS", True)


ABSORBED_KERNEL_ENV = "V1_ABSORBED_KERNEL"


def absorbed_kernel() -> str:
    """V1_ABSORBED_KERNEL, read on each call (tests set it): "cuda" (default) runs the CUDA
    absorbed cross-attention kernel where it serves, "triton" the Triton one always."""
    return os.environ.get(ABSORBED_KERNEL_ENV, "cuda")


def torch_profiler_dir() -> str | None:
    """V1_TORCH_PROFILER_DIR, read when a worker starts: each worker profiles a window of its
    steps with torch.profiler and writes a per-kernel table to DIR/rank<R>.txt (unset: off)."""
    return os.environ.get("V1_TORCH_PROFILER_DIR") or None


def step_trace_dir() -> str | None:
    """V1_STEP_TRACE=DIR, read when an EngineCore starts: it writes one CSV line per scheduled
    step to DIR/steps-<pid>-<n>.csv (`v1.core.step_trace`; unset: off)."""
    return os.environ.get("V1_STEP_TRACE") or None


def torch_profiler_steps() -> tuple[int, int]:
    """V1_TORCH_PROFILER_STEPS "START:STOP" (default "20:40"): the worker steps profiled."""
    start, _, stop = os.environ.get("V1_TORCH_PROFILER_STEPS", "20:40").partition(":")
    return int(start), int(stop)
