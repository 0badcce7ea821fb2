"""`EngineConfig`, the configs together, and the rules that resolve its auto values
(scheduling defaults, the cross-attention mode) and check them across configs."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from v1 import envs
from v1.config.cache import CacheConfig
from v1.config.lora import LoRAConfig
from v1.config.model import ModelConfig
from v1.config.parallel import DeviceConfig, ParallelConfig
from v1.config.scheduler import SchedulerConfig
from v1.models.registry import ModelKind


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
    auto_num_scheduler_steps: bool = False
    """Set when num_scheduler_steps was left to auto and resolved here: decode bursts then run
    only while no scheduled request is streamed (EngineCoreRequest.streamed); a user's value
    bursts streamed requests too (they get several tokens a delta). Not a user argument."""

    def __post_init__(self) -> None:
        self._resolve_auto_scheduling()
        mc, sc = self.model_config, self.scheduler_config
        self._check_lora()
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
        if sc.max_num_batched_tokens is None:
            resolved["max_num_batched_tokens"] = resolve_max_num_batched_tokens(self)
        if sc.num_scheduler_steps is None:
            resolved["num_scheduler_steps"] = resolve_num_scheduler_steps(self)
            object.__setattr__(self, "auto_num_scheduler_steps", True)
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
        """Encoder positions one step may run at most: what the runner, its profiling pass and
        the encoder cache are sized for."""
        sc = self.scheduler_config
        if sc.max_num_encoder_input_tokens is not None:
            return sc.max_num_encoder_input_tokens
        on_gpu = self.device_config.device_type == "cuda"
        return self._encoder_inputs_budget(BACKLOG_ENCODER_INPUTS_FACTOR if on_gpu else 1)

    @property
    def encoder_budget_inputs(self) -> int:
        """Full-length encoder inputs (Whisper's 30 s windows) `encoder_budget` holds (at least
        one)."""
        return max(1, self.encoder_budget // self.model_config.max_encoder_len)

    @property
    def encoder_step_budget(self) -> int:
        """Encoder positions a step runs while few inputs wait. Offline batches (and a user's
        max_num_encoder_input_tokens) always take the whole `encoder_budget`; the server takes
        the model's default share, so a first token does not wait for a wide encoder step, and
        the scheduler widens to `encoder_budget` while more inputs wait than that share holds
        (`Scheduler._encoder_tokens`): those would otherwise wait a whole step each."""
        if self.offline or self.scheduler_config.max_num_encoder_input_tokens is not None:
            return self.encoder_budget
        return min(self.encoder_budget, self._encoder_inputs_budget(1))

    def _encoder_inputs_budget(self, factor: int) -> int:
        """Encoder positions of `factor` times the model's encoder inputs a step (at least a
        step's token budget)."""
        mc = self.model_config
        inputs = mc.spec.encoder_inputs_per_step * factor
        return max(self.scheduler_config.max_num_batched_tokens, inputs * mc.max_encoder_len)

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
        out["auto_num_scheduler_steps"] = self.auto_num_scheduler_steps
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
            auto_num_scheduler_steps=data.get("auto_num_scheduler_steps", False),
        )


# ---- scheduling: the auto defaults (docs/decisions.md, "Scheduling and the step loop") ----
AUTO_MAX_NUM_SEQS_ABSORBED = 512
"""max_num_seqs for an encoder-decoder model with absorbed cross-attention on a GPU: Whisper
turbo, 512 clips, H100: 6,336-6,382 RTFx at max_num_seqs 512 against 6,013-6,220 at 256
(RESULTS.md, session 13); a request holds ~3.1 MiB of KV (fp8) there."""
AUTO_MAX_NUM_SEQS = 128
"""max_num_seqs elsewhere (CPU, decoder-only, per-layer cross-attention, encoder-only on CPU)."""
AUTO_MAX_NUM_SEQS_POOLING = 512
"""max_num_seqs for an encoder-only model on a GPU: it bounds the inputs a step runs (packed or
not) and holds no KV; the tuned BERT rows' value (a 32K-token MiniLM step holds ~240 inputs)."""
AUTO_POOLING_BATCHED_TOKENS = 32768
"""max_num_batched_tokens for an encoder-only model on a GPU: the tuned BERT rows' value. With
the engine's 4,096 a BERT batch runs 8x the steps, each a host step and a small GEMM batch."""
DEFAULT_BATCHED_TOKENS = 4096
"""max_num_batched_tokens elsewhere."""
AUTO_NUM_SCHEDULER_STEPS = 8
"""num_scheduler_steps on a GPU, for requests nobody reads token by token: offline batches
(turbo, 512 clips, H100: 6,142 -> 6,382 RTFx; machines B and D: +3-5%; RESULTS.md, session 13)
and the server's non-streamed transcriptions (session 19)."""
BACKLOG_ENCODER_INPUTS_FACTOR = 2
"""On a GPU a step may encode twice the model's default encoder inputs (Whisper: 32 windows,
the tuned rows' 1500 * 32): fewer mixed steps, so a deep decoder runs fewer decode steps at
partial batches. whisper-large-v3, 256 clips, H200: defaults 2,197 RTFx against 2,422 tuned
(RESULTS.md, session 19). Offline batches always do; the server only while a backlog of
inputs waits (`EngineConfig.encoder_step_budget`): a request's first token waits for its
window's encoder step, and 16 windows were a quarter of the server's gap to offline (session
20, call 15)."""
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
    if _pooling_on_gpu(config):
        return AUTO_MAX_NUM_SEQS_POOLING
    return AUTO_MAX_NUM_SEQS


def resolve_max_num_batched_tokens(config: EngineConfig) -> int:
    """The rule behind max_num_batched_tokens=None."""
    return AUTO_POOLING_BATCHED_TOKENS if _pooling_on_gpu(config) else DEFAULT_BATCHED_TOKENS


def _pooling_on_gpu(config: EngineConfig) -> bool:
    return (
        config.model_config.kind == ModelKind.ENCODER_ONLY
        and config.device_config.device_type == "cuda"
    )


def resolve_num_scheduler_steps(config: EngineConfig) -> int:
    """The rule behind num_scheduler_steps=None: bursts on a GPU (on CPU the device, not the
    host, bounds a step). Auto bursts never run a streamed request (`auto_num_scheduler_steps`):
    a server's streams still get every token as it comes."""
    if config.device_config.device_type == "cuda":
        return AUTO_NUM_SCHEDULER_STEPS
    return 1


POOLING_PACK_TOKENS = 2048
"""Tokens one encoder-only core request may hold when it packs several inputs
(EngineCoreRequest.input_lens), within the step budget: the width of its row in the runner's
persistent batch. A batch of 4096 MiniLM inputs goes to the core as ~270 requests instead of
4096, so the per-request work of the frontend and the core is paid ~15x less often."""


def pooling_row_tokens(config: EngineConfig) -> int:
    """Most tokens of one core request (the runner's row width): the model's limit, and for an
    encoder-only model up to POOLING_PACK_TOKENS of packed inputs (within the step budget)."""
    mc = config.model_config
    limit = mc.effective_max_model_len
    if mc.kind != ModelKind.ENCODER_ONLY:
        return limit
    return max(limit, min(config.scheduler_config.max_num_batched_tokens, POOLING_PACK_TOKENS))


POOLING_PACK_SHARE = 8
"""A packed request holds at most 1/POOLING_PACK_SHARE of a step's token budget and of its
sequences (max_num_seqs), so a step still fills to within about that share of its budget."""


def pooling_pack_limits(config: EngineConfig) -> tuple[int, int]:
    """(tokens, inputs) of the packed requests an offline batch builds (see
    POOLING_PACK_TOKENS); one input a pack: the batch goes unpacked."""
    sc = config.scheduler_config
    tokens = min(pooling_row_tokens(config), sc.max_num_batched_tokens // POOLING_PACK_SHARE)
    return max(tokens, 1), max(sc.max_num_seqs // POOLING_PACK_SHARE, 1)


POOLING_STEPS_IN_FLIGHT = 3
"""max_steps_in_flight for encoder-only models on a GPU: a second queued step keeps the device
busy through a slow host step (a young GC collection, a step finishing ~120 requests), and no
pooling row is ever wasted (each request ends in its one step)."""


def resolve_max_steps_in_flight(config: EngineConfig) -> int:
    """The rule behind max_steps_in_flight=None: 3 for encoder-only models on a GPU, else 2
    (docs/decisions.md: depth 3 gained nothing for Whisper, whose host was the slower side)."""
    if _pooling_on_gpu(config):
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
