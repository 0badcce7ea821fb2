"""Engine configuration: frozen dataclasses for model, cache, scheduler, parallel and device.

Every field has a docstring; validation raises ValueError with a clear message. Model-family
facts (kind, length limits, sliding window) come from the family's `ModelSpec` row
(v1/models/registry.py), never from `model_type` here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from v1 import envs
from v1.logger import init_logger
from v1.model_info import ModelInfo
from v1.models.registry import ModelKind, ModelSpec, architecture_for, get_model_spec

logger = init_logger(__name__)

CROSS_ATTENTION_MODES = ("auto", "per_layer", "absorbed")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch_sdpa")
"""`attention_backend` values: the selector's backends (v1/attention/selector.py), or auto."""
_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")
FP8_IGNORE_REGEX = "re:"
"""Prefix of an `fp8_ignore` entry that is a regular expression over full module names."""


def check_fp8_ignore(ignore: object) -> list[str]:
    """`ignore` as a list of entries, or ValueError when it is not a list of strings or holds
    a regular expression that does not compile (checked before the model loads)."""
    if isinstance(ignore, str) or not isinstance(ignore, Sequence):
        raise ValueError(
            f"fp8_ignore must be a list of module names or 're:' patterns, got {ignore!r}"
        )
    entries = list(ignore)
    for entry in entries:
        if not isinstance(entry, str) or not entry or entry == FP8_IGNORE_REGEX:
            raise ValueError(f"fp8_ignore entries must be non-empty strings, got {entry!r}")
        if entry.startswith(FP8_IGNORE_REGEX):
            try:
                re.compile(entry[len(FP8_IGNORE_REGEX) :])
            except re.error as e:
                raise ValueError(f"fp8_ignore entry {entry!r} is not a valid regex: {e}") from e
    return entries


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how to read it."""

    model: str
    """Local folder or Hugging Face hub id of the model."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to `model`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for model, config and tokenizer."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, the checkpoint's 16-bit dtype on GPU), float32,
    float16 or bfloat16."""
    max_model_len: int | None = None
    """Longest decoder sequence (prompt + output); defaults to the model's limit, capped at its
    sliding window if it has one (no more than the window may be asked for)."""
    max_encoder_input_len: int | None = None
    """Longest encoder input of one request, in encoder positions (encoder-decoder and
    encoder-only models); defaults to the model's limit. Lower it to serve with a smaller KV
    cache (each request reserves cross-attention blocks for its encoder input). Whisper's is
    fixed (1500)."""
    trust_remote_code: bool = False
    """Allow code from the model repository to run (off by default)."""
    seed: int = 0
    """Seed for random weights in tests and for sampling without a per-request seed."""
    quantization: str | None = None
    """fp8: Linear weights in float8_e4m3 with per-output-channel scales, activations scaled
    per token (torch._scaled_mm on sm89+ GPUs, an exact dequantizing reference elsewhere).
    Checkpoints already in fp8 (their quantization_config) are read as fp8 regardless. Which
    Linear layers stay in the model dtype: `fp8_ignore`."""
    fp8_ignore: list[str] | None = None
    """Linear layers fp8 leaves in the model dtype: module names (each covers the Linear layers
    under it, e.g. model.encoder.layers.0) or 're:' regexes a full name must match. Unset: the
    model's default recipe (Whisper: encoder layers 0-1 and the decoder's per-token GEMMs; BERT
    family: all but the first third of the encoder layers; others: none); [] quantizes every
    Linear. With an fp8 checkpoint, these layers are dequantized in addition to its own."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the loaded HF config (for tests and odd checkpoints)."""
    hf_config: Any = field(default=None, compare=False, repr=False)
    """The transformers config; loaded from `model` when not given."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a local folder or a hub id, got an empty string")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_encoder_input_len is not None and self.max_encoder_input_len < 1:
            raise ValueError(
                f"max_encoder_input_len must be >= 1, got {self.max_encoder_input_len}"
            )
        if self.hf_config is None:
            from transformers import AutoConfig

            from v1.model_source import check_model_source

            check_model_source(self.model, revision=self.revision)
            if self.tokenizer and self.tokenizer != self.model:
                check_model_source(self.tokenizer, revision=self.revision, what="tokenizer")
            try:
                cfg = AutoConfig.from_pretrained(
                    self.model, revision=self.revision, trust_remote_code=self.trust_remote_code
                )
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot load a model config from {self.model!r}: {e}") from e
            for key, value in self.hf_overrides.items():
                setattr(cfg, key, value)
            object.__setattr__(self, "hf_config", cfg)
        limit = self.derived_max_model_len
        if self.max_model_len is not None and limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's limit of {limit}"
            )
        self._check_sliding_window()
        self._check_encoder_input_len()
        self._check_fp8_ignore()

    def _check_fp8_ignore(self) -> None:
        if self.fp8_ignore is None:
            return
        object.__setattr__(self, "fp8_ignore", check_fp8_ignore(self.fp8_ignore))
        quantized_checkpoint = getattr(self.hf_config, "quantization_config", None) is not None
        if self.quantization != "fp8" and not quantized_checkpoint:
            raise ValueError(
                "fp8_ignore applies to quantization='fp8' or a checkpoint already in fp8; "
                f"{self.model!r} is neither"
            )

    def _check_encoder_input_len(self) -> None:
        wanted = self.max_encoder_input_len
        if wanted is None:
            return
        if self.kind == ModelKind.DECODER_ONLY:
            raise ValueError(
                f"max_encoder_input_len needs an encoder; {self.architecture} has none"
            )
        limit = self._model_max_encoder_len
        if self.spec.fixed_encoder_len and wanted != limit:
            raise ValueError(
                f"{self.architecture}'s encoder input is always {limit} positions; "
                f"max_encoder_input_len={wanted} cannot change it"
            )
        if wanted > limit:
            raise ValueError(
                f"max_encoder_input_len={wanted} is longer than the model's limit of {limit}"
            )

    def _check_sliding_window(self) -> None:
        """The attention backends have no windowed attention, which equals full attention only
        while a sequence fits in the window: sequences are capped at the window (as vLLM did
        for backends without sliding windows)."""
        window = self.sliding_window
        if window is None:
            return
        if self.max_model_len is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the sliding window of "
                f"{window} tokens of {self.architecture}: the attention backends do not "
                f"implement windowed attention, so sequences are limited to the window"
            )
        limit = self.derived_max_model_len
        if self.max_model_len is None and (limit is None or window < limit):
            logger.warning(
                "max_model_len is capped at %d (the model allows %s): %s uses sliding-window "
                "attention of %d tokens, which the attention backends do not implement; "
                "inside the window full attention is the same",
                window,
                limit,
                self.architecture,
                window,
            )

    # ---- derived values ----
    @cached_property
    def architecture(self) -> str:
        cfg = self.hf_config
        return architecture_for(getattr(cfg, "architectures", None), cfg.model_type)

    @cached_property
    def spec(self) -> ModelSpec:
        """The model family's row (v1/models/registry.py); ValueError when none serves it."""
        return get_model_spec(self.architecture)

    @property
    def kind(self) -> ModelKind:
        return self.spec.kind

    @cached_property
    def info(self) -> ModelInfo:
        """What the model is and can do (v1.model_info), derived once: every part of a process
        (frontend, EngineCore, model states) reads this one."""
        return ModelInfo(self)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @cached_property
    def derived_max_model_len(self) -> int | None:
        """The model's own decoder length limit (None: unbounded, e.g. T5 relative positions)."""
        return self.spec.max_decoder_len(self.hf_config)

    @cached_property
    def sliding_window(self) -> int | None:
        """The attention window transformers applies to some layer (None: every layer attends
        to the whole sequence), by the family's rule (`ModelSpec.window`)."""
        return self.spec.window(self.hf_config)

    @cached_property
    def effective_max_model_len(self) -> int:
        """Longest decoder sequence served: max_model_len, else the model's limit (512 when
        unbounded), capped at the sliding window (see `_check_sliding_window`)."""
        if self.max_model_len is not None:
            return self.max_model_len
        limit = self.derived_max_model_len
        limit = limit if limit is not None else 512
        return limit if self.sliding_window is None else min(limit, self.sliding_window)

    @cached_property
    def max_encoder_len(self) -> int:
        """Longest encoder input of one request, in encoder positions (Whisper: 1500):
        max_encoder_input_len, else the model's limit."""
        if self.max_encoder_input_len is not None:
            return self.max_encoder_input_len
        return self._model_max_encoder_len

    @cached_property
    def _model_max_encoder_len(self) -> int:
        if self.kind == ModelKind.DECODER_ONLY:
            return 0
        return self.spec.max_encoder_len(self.hf_config)

    @cached_property
    def vocab_size(self) -> int:
        """The vocabulary the decoder reads and generates from: Marian with
        share_encoder_decoder_embeddings=False gives the decoder its own `decoder_vocab_size`
        (the LM head's size, as in transformers)."""
        cfg = self.hf_config
        if getattr(cfg, "share_encoder_decoder_embeddings", True) is False:
            return getattr(cfg, "decoder_vocab_size", None) or cfg.vocab_size
        return cfg.vocab_size

    @cached_property
    def encoder_vocab_size(self) -> int:
        """The vocabulary of encoder input ids (Marian: the source vocabulary, `vocab_size`);
        the same as `vocab_size` unless the decoder has its own."""
        return self.hf_config.vocab_size

    def torch_dtype(self, device_type: str) -> Any:
        import torch

        names = {
            "float32": torch.float32,
            "float": torch.float32,
            "fp32": torch.float32,
            "float16": torch.float16,
            "half": torch.float16,
            "fp16": torch.float16,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
        }
        if self.dtype != "auto":
            return names[self.dtype]
        if device_type == "cpu":
            return torch.float32
        cfg_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        if isinstance(cfg_dtype, str):
            cfg_dtype = names.get(cfg_dtype)
        if cfg_dtype in (torch.float16, torch.bfloat16):
            return cfg_dtype
        return torch.bfloat16


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
    """Fraction of GPU memory the engine may use (weights + activations + KV cache)."""
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


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler's knobs."""

    max_num_seqs: int | None = None
    """Most requests in one step. None (auto): EngineConfig resolves it once
    (`resolve_max_num_seqs`, docs/decisions.md): 512 for an encoder-decoder model with absorbed
    cross-attention on a GPU (a Whisper request holds ~3 MiB of KV there), else 128; the engine
    core then lowers an auto value to the requests its KV cache holds at a typical length."""
    max_num_batched_tokens: int = 4096
    """Most decoder (or encoder-only) tokens in one step."""
    max_num_encoder_input_tokens: int | None = None
    """Encoder positions one step may run (default: max(max_num_batched_tokens, the model's max
    encoder length)). Distinct from the model's max encoder length of one request."""
    encoder_cache_size: int | None = None
    """Encoder positions the encoder cache holds (default: the per-step encoder budget)."""
    policy: str = "fcfs"
    """Admission order: fcfs, or priority (lower value first, then arrival)."""
    enable_chunked_prefill: bool = True
    """Split long decoder prompts across steps."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before waiting for step N's results, so host work overlaps
    the device; tokens sampled by step N feed step N+1 on the device and the host reads them one
    step behind. None: on for every model kind on CUDA, off on CPU."""
    max_steps_in_flight: int | None = None
    """Pipelined scheduling depth: launched steps not yet read back (the step the device runs
    and those queued behind it). 2 overlaps one step's host work with the device; 3 also
    absorbs a slow host step (a GC pause, a batch of finishing requests) with a second queued
    step, at the cost of one more wasted row per request that ends on EOS. None (auto): 3 for
    encoder-only (pooling) models on a GPU, whose requests end in their one step (no row is
    wasted), else 2; EngineConfig resolves it (`resolve_max_steps_in_flight`)."""

    num_scheduler_steps: int | None = None
    """Decode steps one engine step runs on the device when every request it schedules is
    decoding (no admission, no prefill chunk, no grammar, no word timestamps): the host
    schedules, reads back and processes outputs once per up to this many tokens of each request,
    so a large batch's per-step host work stops bounding the device (vLLM V0's multi-step
    scheduling). A request that ends inside such a step (EOS, a stop, max_tokens) wastes the
    rest of it; max_model_len shortens it. 1: one token per engine step. None (auto): 8 for
    offline batches (`LLM`, where nothing streams per token) on a GPU, else 1 (the server streams
    every token); EngineConfig resolves it (`resolve_num_scheduler_steps`)."""

    def __post_init__(self) -> None:
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 64:
            raise ValueError(
                f"num_scheduler_steps must be in [1, 64], got {self.num_scheduler_steps}"
            )
        if self.max_steps_in_flight is not None and not 2 <= self.max_steps_in_flight <= 4:
            raise ValueError(
                f"max_steps_in_flight must be in [2, 4], got {self.max_steps_in_flight} "
                "(async_scheduling=False runs steps one at a time)"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices."""

    tensor_parallel_size: int = 1
    """Devices one model is sharded over: one worker process per rank (rank 0 inside the
    EngineCore process), linked by torch.distributed (gloo on CPU, NCCL on CUDA)."""
    distributed_executor_backend: str | None = None
    """How the ranks' workers are placed: "mp" (processes on this machine; the default when
    tensor_parallel_size > 1) or "ray" (Ray actors in a placement group, across nodes; needs the
    `ray` extra). None with tensor_parallel_size=1: the worker runs inside the EngineCore."""
    data_parallel_size: int = 1
    """EngineCore processes serving the model side by side, each on its own device set
    (tensor_parallel_size devices); the frontend sends each request to the least-loaded one."""

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
            )

    @property
    def executor_backend(self) -> str:
        """uni (one worker in the core: always with tensor_parallel_size=1), mp or ray."""
        if self.tensor_parallel_size == 1:
            return "uni"
        return self.distributed_executor_backend or "mp"


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""

    def __post_init__(self) -> None:
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @cached_property
    def resolved(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_type(self) -> str:
        return self.resolved.split(":")[0]

    @staticmethod
    def visible_cuda_devices() -> list[str]:
        """The ids of the CUDA devices this process may use (CUDA_VISIBLE_DEVICES or all)."""
        listed = envs.cuda_visible_devices()
        if listed is not None:
            return listed
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: PEFT adapters chosen per request (v1/lora/)."""

    enable_lora: bool = False
    """Serve LoRA adapters (requests name one with `lora_request`)."""
    max_loras: int = 1
    """Adapters one step may run together: the slots on the device (and the most distinct
    adapters among running requests)."""
    max_lora_rank: int = 16
    """Highest adapter rank accepted (the slots' rank; smaller ranks are zero-padded)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used ones dropped); None: max_loras."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core, worker and frontends need to agree on."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    offline: bool = False
    """Built for offline batches (`LLM`): no output streams per token, so the auto
    num_scheduler_steps may run decode bursts. The server leaves it False."""
    auto_max_num_seqs: bool = False
    """Set when max_num_seqs was left to auto and resolved here: the engine core may lower it
    to what its KV cache holds (`kv_bounded_max_num_seqs`). Not a user argument."""

    def __post_init__(self) -> None:
        self._resolve_auto_scheduling()
        mc, sc = self.model_config, self.scheduler_config
        self._check_lora()
        if mc.kind == ModelKind.ENCODER_ONLY and sc.max_num_batched_tokens < mc.max_encoder_len:
            # An encoder-only request runs whole in one step; a budget below the model's limit
            # only narrows the longest accepted input (validated per request).
            pass
        if (
            mc.kind != ModelKind.DECODER_ONLY
            and sc.max_num_encoder_input_tokens is not None
            and sc.max_num_encoder_input_tokens < mc.max_encoder_len
            and mc.spec.fixed_encoder_len
        ):
            raise ValueError(
                f"max_num_encoder_input_tokens={sc.max_num_encoder_input_tokens} is below one "
                f"encoder input of {mc.architecture} ({mc.max_encoder_len} encoder positions)"
            )

        _check_tensor_parallel_heads(mc.hf_config, self.parallel_config.tensor_parallel_size)
        if self.cache_config.cross_attention == "absorbed" and mc.kind != ModelKind.ENCODER_DECODER:
            raise ValueError(
                f"cross_attention='absorbed' needs an encoder-decoder model, not {mc.architecture}"
            )

    def _check_lora(self) -> None:
        """LoRA adds its product inside whole (unsharded) 16/32-bit Linears and needs per-layer
        cross-attention (the K/V projections of the encoder output carry adapters)."""
        if not self.lora_config.enable_lora:
            return
        mc = self.model_config
        if mc.kind == ModelKind.ENCODER_ONLY:
            raise ValueError(f"enable_lora serves generating models, not {mc.architecture}")
        if self.parallel_config.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported")
        if mc.quantization is not None:
            raise ValueError("enable_lora with quantization is not supported")
        if self.cache_config.cross_attention == "absorbed":
            raise ValueError(
                "enable_lora needs cross_attention='per_layer' (or 'auto'): adapters on the "
                "cross-attention K/V projections change them per request"
            )

    def _resolve_auto_scheduling(self) -> None:
        """Replaces the auto (None) scheduler values by the resolved ones, once: every reader
        (scheduler, runner, frontends, other processes via to_json) sees plain ints."""
        sc = self.scheduler_config
        resolved: dict[str, int] = {}
        if sc.max_num_seqs is None:
            resolved["max_num_seqs"] = resolve_max_num_seqs(self)
            object.__setattr__(self, "auto_max_num_seqs", True)
        if sc.num_scheduler_steps is None:
            resolved["num_scheduler_steps"] = resolve_num_scheduler_steps(self)
        if sc.max_steps_in_flight is None:
            resolved["max_steps_in_flight"] = resolve_max_steps_in_flight(self)
        if resolved:
            object.__setattr__(self, "scheduler_config", dataclasses.replace(sc, **resolved))

    @cached_property
    def cross_attention_mode(self) -> str:
        """per_layer or absorbed: `cache_config.cross_attention` resolved, before the model is
        built; the runner, its cache specs and every TP rank read this one value."""
        return resolve_cross_attention(self)

    @property
    def use_async_scheduling(self) -> bool:
        """Pipelined steps (SchedulerConfig.async_scheduling, resolved for this model/device)."""
        flag = self.scheduler_config.async_scheduling
        if flag is None:
            return self.device_config.device_type == "cuda"
        return flag

    @property
    def encoder_budget(self) -> int:
        sc = self.scheduler_config
        if sc.max_num_encoder_input_tokens is not None:
            return sc.max_num_encoder_input_tokens
        mc = self.model_config
        per_step = mc.spec.encoder_inputs_per_step * mc.max_encoder_len
        return max(sc.max_num_batched_tokens, per_step)

    @property
    def encoder_cache_size(self) -> int:
        sc = self.scheduler_config
        if sc.encoder_cache_size is not None:
            return sc.encoder_cache_size
        # Room for a second step's worth, so outputs shared by content hash (language
        # detection, then transcription) survive until their second use.
        return 2 * self.encoder_budget

    def to_json(self) -> str:
        """Plain JSON of the user-set fields, for passing to an EngineCore process."""
        out = {}
        for name in ("cache_config", "scheduler_config", "parallel_config", "device_config"):
            out[name] = dataclasses.asdict(getattr(self, name))
        mc = self.model_config
        out["model_config"] = {
            f.name: getattr(mc, f.name) for f in dataclasses.fields(mc) if f.name != "hf_config"
        }
        out["enforce_eager"] = self.enforce_eager
        out["lora_config"] = dataclasses.asdict(self.lora_config)
        out["offline"] = self.offline
        out["auto_max_num_seqs"] = self.auto_max_num_seqs
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        return cls(
            model_config=ModelConfig(**data["model_config"]),
            cache_config=CacheConfig(**data["cache_config"]),
            scheduler_config=SchedulerConfig(**data["scheduler_config"]),
            parallel_config=ParallelConfig(**data["parallel_config"]),
            device_config=DeviceConfig(**data["device_config"]),
            enforce_eager=data["enforce_eager"],
            lora_config=LoRAConfig(**data.get("lora_config", {})),
            offline=data.get("offline", False),
            auto_max_num_seqs=data.get("auto_max_num_seqs", False),
        )


# ---- scheduling: the auto defaults (docs/decisions.md, "Scheduling and the step loop") ----
AUTO_MAX_NUM_SEQS_ABSORBED = 512
"""max_num_seqs for an encoder-decoder model with absorbed cross-attention on a GPU: Whisper
turbo, 512 clips, H100: 6,336-6,382 RTFx at max_num_seqs 512 against 6,013-6,220 at 256
(RESULTS.md, session 13); a request holds ~3.1 MiB of KV (fp8) there."""
AUTO_MAX_NUM_SEQS = 128
"""max_num_seqs elsewhere (CPU, decoder-only, encoder-only, per-layer cross-attention)."""
OFFLINE_NUM_SCHEDULER_STEPS = 8
"""num_scheduler_steps for offline batches on a GPU: turbo, 512 clips, H100: 6,142 -> 6,382
RTFx (machines B and D: +3-5%) (RESULTS.md, session 13)."""
TYPICAL_DECODER_TOKENS = 256
"""Decoder tokens of a typical request when the core sizes an auto max_num_seqs by its KV cache
(capped by max_model_len); an encoder-decoder request adds its whole encoder input."""


def resolve_max_num_seqs(config: EngineConfig) -> int:
    """The rule behind max_num_seqs=None (before the KV cache is sized; the core may lower it,
    `kv_bounded_max_num_seqs`)."""
    if (
        config.device_config.device_type == "cuda"
        and config.model_config.kind == ModelKind.ENCODER_DECODER
        and config.cross_attention_mode == "absorbed"
    ):
        return AUTO_MAX_NUM_SEQS_ABSORBED
    return AUTO_MAX_NUM_SEQS


def resolve_num_scheduler_steps(config: EngineConfig) -> int:
    """The rule behind num_scheduler_steps=None: bursts for offline batches on a GPU only (the
    server streams each token; on CPU the device, not the host, bounds a step)."""
    if config.offline and config.device_config.device_type == "cuda":
        return OFFLINE_NUM_SCHEDULER_STEPS
    return 1


POOLING_STEPS_IN_FLIGHT = 3
"""max_steps_in_flight for encoder-only models on a GPU: a second queued step keeps the device
busy through a slow host step (a young GC collection, a step finishing ~120 requests), and no
pooling row is ever wasted (each request ends in its one step)."""


def resolve_max_steps_in_flight(config: EngineConfig) -> int:
    """The rule behind max_steps_in_flight=None: 3 for encoder-only models on a GPU, else 2
    (docs/decisions.md: depth 3 gained nothing for Whisper, whose host was the slower side)."""
    if (
        config.model_config.kind == ModelKind.ENCODER_ONLY
        and config.device_config.device_type == "cuda"
    ):
        return POOLING_STEPS_IN_FLIGHT
    return 2


def kv_bounded_max_num_seqs(config: EngineConfig, requests_that_fit: int) -> int:
    """max_num_seqs once the KV cache is sized: an auto value lowered to `requests_that_fit`
    (requests of a typical length the cache holds, at least 1); a user's value as given."""
    max_num_seqs = config.scheduler_config.max_num_seqs
    assert max_num_seqs is not None
    if not config.auto_max_num_seqs:
        return max_num_seqs
    return max(1, min(max_num_seqs, requests_that_fit))


# ---- attention: the cross-attention rule (torch-free facts; floor 2 sees no v1.attention) ----
def resolve_cross_attention(config: EngineConfig) -> str:
    """The rule behind cross_attention="auto" (docs/decisions.md, cross-attention): per_layer on CPU and for models without cross-attention (absorbed
    attends over d_model-wide rows: compute-bound there); on a GPU absorbed, except with an fp8
    KV cache where only the Triton kernel takes fp8 states (its fp8 path loses to per-layer)."""
    mode = config.cache_config.cross_attention
    if mode != "auto":
        return mode
    if config.lora_config.enable_lora:
        return "per_layer"
    device_type = config.device_config.device_type
    if device_type != "cuda" or config.model_config.kind != ModelKind.ENCODER_DECODER:
        return "per_layer"
    if config.cache_config.fp8_kv_cache and not _cuda_kernel_takes_fp8_states(config):
        return "per_layer"
    return "absorbed"


def _cuda_kernel_takes_fp8_states(config: EngineConfig) -> bool:
    """Whether the CUDA absorbed kernel serves fp8 encoder states: 16-bit models on sm_89+."""
    dtype = str(config.model_config.torch_dtype("cuda")).removeprefix("torch.")
    if envs.absorbed_kernel() != "cuda" or dtype not in _16_BIT:
        return False
    import torch

    return torch.cuda.get_device_capability() >= (8, 9)


_16_BIT = ("float16", "bfloat16")


def attention_types(model_config: ModelConfig) -> tuple[str, ...]:
    """The `AttentionType` values a model's layers use (its backend must serve all)."""
    kind = model_config.kind
    if kind == ModelKind.ENCODER_ONLY:
        return ("encoder_only",)
    if kind == ModelKind.ENCODER_DECODER:
        return ("encoder", "decoder", "encoder_decoder")
    return ("decoder",)


_HEAD_COUNTS = (
    "num_attention_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_heads",
)


def _check_tensor_parallel_heads(hf_config: Any, tp_size: int) -> None:
    """Attention heads must split evenly over the ranks (kv heads may also be fewer than the
    ranks and divide them: each rank then keeps a copy of one)."""
    if tp_size == 1:
        return
    for name in _HEAD_COUNTS:
        heads = getattr(hf_config, name, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide the attention heads "
                f"({name}={heads})"
            )
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if isinstance(kv_heads, int) and kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the attention heads "
            f"(num_key_value_heads={kv_heads}) and is not a multiple of them"
        )


_ENGINE_ARG_OWNERS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    LoRAConfig,
)


def engine_arg_fields() -> list[tuple[type, dataclasses.Field]]:
    """Every user-settable engine argument with the dataclass that owns it (CLI --help uses it)."""
    out = []
    for owner in _ENGINE_ARG_OWNERS:
        for f in dataclasses.fields(owner):
            if f.name not in ("hf_config", "model", "hf_overrides"):
                out.append((owner, f))
    return out


def make_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`LLM(model, block_size=..., ...)`)."""
    parts: dict[type, dict[str, Any]] = {owner: {} for owner in _ENGINE_ARG_OWNERS}
    enforce_eager = bool(kwargs.pop("enforce_eager", False))
    offline = bool(kwargs.pop("offline", False))
    hf_config = kwargs.pop("hf_config", None)
    names = {f.name: owner for owner in _ENGINE_ARG_OWNERS for f in dataclasses.fields(owner)}
    for key, value in kwargs.items():
        if key not in names or key in ("model", "hf_config"):
            raise ValueError(f"unknown engine argument {key!r}")
        parts[names[key]][key] = value
    model_config = ModelConfig(model=model, hf_config=hf_config, **parts[ModelConfig])
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(**parts[CacheConfig]),
        scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
        parallel_config=ParallelConfig(**parts[ParallelConfig]),
        device_config=DeviceConfig(**parts[DeviceConfig]),
        enforce_eager=enforce_eager,
        lora_config=LoRAConfig(**parts[LoRAConfig]),
        offline=offline,
    )
