"""The paged KV cache's config (`CacheConfig`) and the values its fields accept."""

from __future__ import annotations

from dataclasses import dataclass

from v1 import envs

CROSS_ATTENTION_MODES = ("auto", "per_layer", "absorbed")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch_sdpa")
"""`attention_backend` values: the selector's backends (v1/attention/selector.py), or auto."""


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides memory-based sizing; block 0 is the null block)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache (CPU default: V1_CPU_KV_CACHE_BYTES, 1 GiB)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory this engine may use (weights + activations + KV cache), as
    in vLLM: memory other processes hold does not count against it, so two engines at 0.4
    share a GPU; a share the device cannot hold is a ValueError at start-up
    (v1/worker/gpu_memory)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical decoder-prompt prefixes (decoder self-attention only)."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) or fp8 (float8_e4m3 with a float32 scale per token and head,
    dequantized inside attention): self-attention K/V, cross K/V and encoder states."""
    cross_attention: str = "auto"
    """Encoder-decoder cross-attention: per_layer (each decoder layer caches its own K/V of the
    encoder output), absorbed (the encoder output is cached once and every layer attends over it
    through its query projected by W_k, exact), or auto (`EngineConfig.cross_attention_mode`
    resolves it; see docs/decisions.md, "Cross-attention")."""
    attention_backend: str = "auto"
    """auto (the first of flash_attn, triton, torch_sdpa whose capabilities serve the model on
    the device) or one of those names, which must then serve it (else a ValueError says why)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.cross_attention not in CROSS_ATTENTION_MODES:
            raise ValueError(
                f"cross_attention must be one of {CROSS_ATTENTION_MODES}, got "
                f"{self.cross_attention!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                f"{self.attention_backend!r}"
            )

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def cpu_kv_cache_bytes(self) -> int:
        return self.kv_cache_memory_bytes or envs.V1_CPU_KV_CACHE_BYTES
