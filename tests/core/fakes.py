"""Factories and a scripted fake executor for scheduler and engine-core tests (no model)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from transformers import BartConfig, BertConfig, LlamaConfig

from v1.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from v1.core.engine_core import EngineCore
from v1.core.protocol import EncoderInput, EngineCoreRequest
from v1.core.request import Request
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.core.scheduler import Scheduler
from v1.kv_cache.sizing import get_kv_cache_config
from v1.kv_cache.spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

EOS = 2
VOCAB = 100


def _hf_config(kind: str, max_positions: int = 256) -> Any:
    if kind == "encoder_decoder":
        return BartConfig(
            vocab_size=VOCAB,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            max_position_embeddings=max_positions,
            architectures=["BartForConditionalGeneration"],
        )
    if kind == "encoder_only":
        return BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=max_positions,
            architectures=["BertModel"],
        )
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=max_positions,
        architectures=["LlamaForCausalLM"],
    )


def make_config(kind: str = "decoder_only", **overrides: Any) -> EngineConfig:
    cache_keys = {"block_size", "num_kv_blocks", "enable_prefix_caching"}
    cache = {k: overrides.pop(k) for k in list(overrides) if k in cache_keys}
    cache.setdefault("num_kv_blocks", 65)  # one request of max_model_len=256 fits
    cache.setdefault("block_size", 4)
    max_model_len = overrides.pop("max_model_len", None)
    hf_config = _hf_config(kind, overrides.pop("max_positions", 256))
    return EngineConfig(
        model_config=ModelConfig(
            model=f"fake-{kind}", hf_config=hf_config, max_model_len=max_model_len
        ),
        cache_config=CacheConfig(**cache),
        scheduler_config=SchedulerConfig(**overrides),
    )


def layer_specs(config: EngineConfig) -> dict[str, KVCacheSpec]:
    bs = config.cache_config.block_size
    specs: dict[str, KVCacheSpec] = {"layers.0.self_attn": FullAttentionSpec(bs, 1, 8, "float32")}
    if config.model_config.kind.value == "encoder_decoder":
        specs["layers.0.cross_attn"] = CrossAttentionSpec(bs, 1, 8, "float32")
    if config.model_config.kind.value == "encoder_only":
        return {}
    return specs


def make_scheduler(kind: str = "decoder_only", **overrides: Any) -> Scheduler:
    config = make_config(kind, **overrides)
    kv_config = get_kv_cache_config(
        layer_specs(config), num_blocks=config.cache_config.num_kv_blocks
    )
    return Scheduler(config, kv_config)


def make_request(
    req_id: str,
    prompt_len: int = 8,
    max_tokens: int = 8,
    *,
    encoder_len: int = 0,
    encoder_hash: str | None = None,
    pooling: bool = False,
    priority: int = 0,
    arrival_time: float = 0.0,
    ignore_eos: bool = True,
    prompt: list[int] | None = None,
) -> Request:
    tokens = (
        prompt if prompt is not None else [3 + (hash((req_id, i)) % 90) for i in range(prompt_len)]
    )
    encoder_input = None
    if encoder_len:
        encoder_input = EncoderInput(
            num_encoder_tokens=encoder_len,
            content_hash=encoder_hash or f"h-{req_id}",
            token_ids=list(range(encoder_len)),
        )
    return Request(
        req_id,
        tokens,
        None if pooling else SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        PoolingParams() if pooling else None,
        encoder_input=encoder_input,
        eos_token_id=EOS,
        priority=priority,
        arrival_time=arrival_time,
    )


def make_requests(n: int, **kwargs: Any) -> list[Request]:
    return [make_request(f"r{i}", arrival_time=float(i), **kwargs) for i in range(n)]


def to_core_request(request: Request) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        pooling_params=request.pooling_params,
        encoder_input=request.encoder_input,
        eos_token_id=request.eos_token_id,
        arrival_time=request.arrival_time,
        priority=request.priority,
    )


class FakeRunner:
    """Mirrors the model runner's bookkeeping: samples a token for every request whose
    scheduled chunk reaches the end of its known tokens; `token_fn(req_id, step)` picks it."""

    def __init__(self, token_fn: Any = None) -> None:
        self.token_fn = token_fn or (lambda req_id, n: 10 + n % 50)
        self.num_tokens: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.pooling: set[str] = set()
        self.encoder_hashes: set[str] = set()
        self.num_encoder_runs = 0
        self.cross_writes: list[str] = []

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.num_tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        for h in so.free_encoder_hashes:
            self.encoder_hashes.discard(h)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.num_tokens, f"{new.req_id} added twice"
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        for req_id, n in zip(
            so.scheduled_cached_reqs.req_ids,
            so.scheduled_cached_reqs.num_computed_tokens,
            strict=True,
        ):
            assert self.computed[req_id] == n, (req_id, self.computed[req_id], n)
        for h in so.encoder_hashes_to_run:
            assert h not in self.encoder_hashes, f"encoder of {h} run twice while cached"
            self.encoder_hashes.add(h)
            self.num_encoder_runs += 1
        self.cross_writes.extend(so.encoder_reqs)
        req_ids = list(so.num_scheduled_tokens)
        sampled, pooled = [], []
        for req_id in req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
            assert self.computed[req_id] <= self.num_tokens[req_id]
            if req_id in self.pooling:
                sampled.append([])
                pooled.append(np.full(4, self.computed[req_id], dtype=np.float32))
            elif self.computed[req_id] == self.num_tokens[req_id]:
                sampled.append([self.token_fn(req_id, self.num_tokens[req_id])])
                self.num_tokens[req_id] += 1
                pooled.append(None)
            else:
                sampled.append([])
                pooled.append(None)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            pooler_output=pooled,
            num_encoder_runs=len(so.encoder_hashes_to_run),
        )


class FakeExecutor:
    """A scripted Executor for EngineCore tests."""

    def __init__(self, config: EngineConfig, token_fn: Any = None, fail_on: Any = None) -> None:
        self.config = config
        self.runner = FakeRunner(token_fn)
        self.fail_on = fail_on
        self.fail_on_read: Any = None
        self.steps = 0
        self.events: list[tuple[str, int]] = []

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return layer_specs(self.config)

    def determine_available_kv_bytes(self) -> int:
        return 1 << 20

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        if self.fail_on is not None and self.fail_on(so):
            raise RuntimeError("scripted step failure")
        return self.runner(so)

    def execute_model_async(self, so: SchedulerOutput) -> FakeDeferred:
        """The runner's bookkeeping happens at launch, as on a device; the output is handed
        over when read. `events` logs ("launch" | "read", step number)."""
        output = self.execute_model(so)
        step = self.steps
        self.events.append(("launch", step))
        fail = self.fail_on_read is not None and self.fail_on_read(so)
        return FakeDeferred(self, step, output, fail)

    def shutdown(self) -> None:
        return None


class FakeDeferred:
    def __init__(self, executor: FakeExecutor, step: int, output: Any, fail: bool) -> None:
        self.executor, self.step, self.output, self.fail = executor, step, output, fail

    def get_output(self) -> ModelRunnerOutput:
        self.executor.events.append(("read", self.step))
        if self.fail:
            raise RuntimeError("scripted device failure")
        return self.output


def make_engine_core(
    kind: str = "decoder_only", token_fn: Any = None, fail_on: Any = None, **overrides: Any
) -> EngineCore:
    config = make_config(kind, **overrides)
    return EngineCore(config, lambda c: FakeExecutor(c, token_fn, fail_on))


def run_scheduler_step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, Any]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, runner(so))


def rng(seed: int) -> random.Random:
    return random.Random(seed)
