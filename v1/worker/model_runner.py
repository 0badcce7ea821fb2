"""ModelRunner: applies SchedulerOutput deltas to the persistent batch, builds step inputs and
runs each step as prepare (the model-kind strategy), main pass (CUDA graph replay or eager) and
finish. It alone owns the model, KV cache, batch, attention metadata and graphs; it asks the
attention backend's capabilities, never its name.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch

from v1.attention.backend import AttentionType
from v1.attention.cross_attention import ENCODER_STATES_LAYER, EncoderDecoderAttention
from v1.attention.layer import Attention
from v1.attention.selector import AttentionNeeds, select_backend, use_backend
from v1.config import EngineConfig, attention_types, pooling_row_tokens
from v1.core.sched_output import (
    BurstRunnerOutput,
    DeferredRunnerOutput,
    ModelRunnerOutput,
    ReadyRunnerOutput,
    SchedulerOutput,
)
from v1.host_copy import parts_to_device
from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    encoder_states_spec_in_pool,
)
from v1.logger import init_logger
from v1.worker.attn_metadata import AttentionMetadataFactory
from v1.worker.gpu_memory import MemoryBaseline, kv_cache_bytes
from v1.worker.input_batch import InputBatch
from v1.worker.kv_cache_views import KVBlockCopier, LayerCache, allocate_kv_cache
from v1.worker.model_states import ModelState, StateContext, make_model_state
from v1.worker.step_inputs import StepInputs, padded_num_tokens, pads_tokens

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.dtype = self.model_config.torch_dtype(device.type)
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_model_len = self.model_config.effective_max_model_len
        self.block_size = config.cache_config.block_size
        fp8_kv_cache = config.cache_config.fp8_kv_cache
        self.cross_attention = config.cross_attention_mode
        """per_layer or absorbed (resolved by the config before the model is built)."""
        self.attn_backend = select_backend(
            self.attention_needs(config, device), config.cache_config.attention_backend
        )
        self.backend_name = self.attn_backend.name
        self.kv_cache_dtype = (
            "float8_e4m3fn" if fp8_kv_cache else str(self.dtype).removeprefix("torch.")
        )
        """KV cache spec dtype (fp8 caches keep float32 scales beside their rows)."""
        self.attn_metadata = AttentionMetadataFactory(self.attn_backend, device, self.block_size)
        self.input_batch = InputBatch(
            self.max_num_reqs,
            pooling_row_tokens(config),  # packed encoder-only inputs may pass max_model_len
            config.scheduler_config.max_steps_in_flight if config.use_async_scheduling else 2,
        )
        self.model: Any = None
        self.tp: Any = None
        """This rank's TensorParallelGroup (set by the worker; None: the whole model here)."""
        self.state: ModelState | None = None
        """The model-kind strategy, built by `load_model` (None before, and after shutdown)."""
        self.attn_layers: dict[str, Attention] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.cuda_graphs: Any = None
        self.encoder_states: LayerCache | None = None
        """The encoder-states cache (absorbed cross-attention)."""
        self.lora: Any = None
        """The LoRAModelManager (enable_lora), attached to the model at load."""
        self.lora_ids: dict[str, int] = {}
        """Requests in the batch that run an adapter -> its id (released when they leave)."""
        self.failed_requests: dict[str, str] = {}
        """Requests failed alone while entering the batch (adapter unreadable) -> the error,
        reported with the step's output."""

    # ---- set-up ----
    @staticmethod
    def attention_needs(config: EngineConfig, device: torch.device) -> AttentionNeeds:
        """What the model on `device` asks of its attention backend."""
        cuda = device.type == "cuda"
        return AttentionNeeds(
            attn_types=frozenset(AttentionType(t) for t in attention_types(config.model_config)),
            device_type=device.type,
            compute_capability=torch.cuda.get_device_capability(device) if cuda else None,
            encoder_states=config.cross_attention_mode == "absorbed",
            bias=config.model_config.spec.attention_bias is not None,
            fp8_kv_cache=config.cache_config.fp8_kv_cache,
            block_size=config.cache_config.block_size,
        )

    def load_model(self) -> None:
        from v1.worker.model_loader import load_model

        if self.device.type == "cuda":
            # Give back the cached blocks of an engine shut down earlier in this process
            # before the weights land in them: a weight inside the old KV segment pins it,
            # and the new KV cache (sized from the device's memory) then finds no room.
            gc.collect()
            torch.cuda.empty_cache()
        with use_backend(self.backend_name):
            self.model = load_model(self.model_config, self.device, self.dtype, tp=self.tp)
        self.model.eval()
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        self.attn_metadata.set_layers({n: m.attn_type for n, m in self.attn_layers.items()})
        self._apply_cross_attention()
        if self.config.lora_config.enable_lora:
            from v1.lora import LoRAModelManager

            sc = self.config.scheduler_config
            self.lora = LoRAModelManager(
                self.model,
                self.config.lora_config,
                max_decoder_rows=padded_num_tokens(max(sc.max_num_batched_tokens, sc.max_num_seqs)),
                max_encoder_rows=padded_num_tokens(self.config.encoder_budget),
                device=self.device,
                dtype=self.dtype,
            )
        self.state = make_model_state(
            StateContext(
                model=self.model,
                input_batch=self.input_batch,
                attn_metadata=self.attn_metadata,
                device=self.device,
                config=self.config,
                lora=self.lora,
            )
        )

    def _apply_cross_attention(self) -> None:
        """The config's mode on the loaded cross-attention layers (before the cache exists: its
        layout follows the mode, and a memory profile runs the mode's activations)."""
        absorbed = self.cross_attention == "absorbed" and self.has_cross_attention
        for layer in self.attn_layers.values():
            if isinstance(layer, EncoderDecoderAttention):
                layer.absorbed = absorbed
        from v1.attention.ops.absorbed_cross_attention import dequantize_for_absorbed

        if dequantize_for_absorbed(self.model, self.dtype if absorbed else None):
            logger.info("absorbed cross-attention: fp8 K/V projections dequantized once")

    @property
    def has_cross_attention(self) -> bool:
        return any(isinstance(m, EncoderDecoderAttention) for m in self.attn_layers.values())

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec; absorbed cross-attention replaces the cross layers' specs by the
        one encoder-states pseudo-layer."""
        dtype = self.kv_cache_dtype
        kinds = {
            AttentionType.DECODER: FullAttentionSpec,
            AttentionType.ENCODER_DECODER: CrossAttentionSpec,
        }
        specs: dict[str, KVCacheSpec] = {
            name: kinds.get(layer.attn_type, EncoderOnlyAttentionSpec)(
                block_size=self.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                dtype=dtype,
            )
            for name, layer in self.attn_layers.items()
        }
        if self.cross_attention == "absorbed" and self.has_cross_attention:
            self_attention = [s for s in specs.values() if isinstance(s, FullAttentionSpec)]
            specs = {n: s for n, s in specs.items() if not isinstance(s, CrossAttentionSpec)}
            d_model = self.model_config.hf_config.d_model
            # A states block fills the page of every self-attention layer's tensor.
            specs[ENCODER_STATES_LAYER] = encoder_states_spec_in_pool(
                self_attention[0], d_model, span=len(self_attention)
            )
        return specs

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        if self.device.type == "cuda":
            # Cycles of an engine shut down meanwhile may still hold cached blocks.
            gc.collect()
            torch.cuda.empty_cache()
        kv_caches = allocate_kv_cache(kv_cache_config, self.device)
        self.copy_blocks = KVBlockCopier(kv_cache_config, kv_caches)
        for name, cache in kv_caches.items():
            if name == ENCODER_STATES_LAYER:
                self.encoder_states = cache
                for layer in self.attn_layers.values():
                    if isinstance(layer, EncoderDecoderAttention):
                        layer.bind_encoder_states(cache.values, cache.scales)
            else:
                self.attn_layers[name].kv_cache = cache.values
                self.attn_layers[name].kv_scales = cache.scales
        self.attn_metadata.initialize(
            kv_cache_config,
            self.max_num_reqs,
            self.max_model_len,
            self.model_config.max_encoder_len,
        )
        self.state.on_kv_cache_ready(kv_caches)
        self.cuda_graphs = None
        if self.use_cuda_graphs:
            from v1.worker.cuda_graphs import CudaGraphManager

            self.cuda_graphs = CudaGraphManager.create(
                self.attn_metadata,
                self.input_batch,
                self.state.decode_forward,
                self.config.scheduler_config.max_num_batched_tokens,
            )
            self.cuda_graphs.capture()

    @property
    def use_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.attn_backend.capabilities.decode_cuda_graphs
            and self.state.supports_cuda_graphs
        )

    # ---- the step ----
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        """Launches the step without waiting for it (pipelined scheduling): everything here
        is enqueued on the device stream, so the next step can be prepared meanwhile."""
        self._update_states(scheduler_output)
        if self.failed_requests:
            failed, self.failed_requests = self.failed_requests, {}
            return _WithFailed(self._execute(scheduler_output), failed)
        return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        self.copy_blocks(scheduler_output.block_copies)  # forks: before any step reads them
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ReadyRunnerOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        step = self._prepare_inputs(scheduler_output)
        self.state.prepare_step(step, scheduler_output)
        output = self._main_pass_and_finish(step, scheduler_output)
        if scheduler_output.num_decode_steps == 1:
            return output
        # A decode burst: each later step feeds every request the token the one before it
        # sampled (still on the device: it is pending in the persistent batch).
        outputs = [output]
        batch, slots = self.input_batch, step.slots
        batch.continues_step = True
        try:
            for _ in range(scheduler_output.num_decode_steps - 1):
                batch.num_computed_tokens[slots] += 1
                step = self._prepare_inputs(scheduler_output)
                outputs.append(self._main_pass_and_finish(step, scheduler_output))
        finally:
            batch.continues_step = False
        return BurstRunnerOutput(outputs)

    def _main_pass_and_finish(self, step: StepInputs, so: SchedulerOutput) -> DeferredRunnerOutput:
        # Every step's one choice between graph and eager: the pre-step wrote what the graphs
        # only read (cross K/V), so any step that fits a graph replays one.
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(step, so):
            hidden_states = graphs.run(step)
        else:
            hidden_states = self.state.forward(step, so)[: step.num_tokens]
        return self.state.finish_step(hidden_states, step, so)

    def _update_states(self, so: SchedulerOutput) -> None:
        """Applies the step's delta to the persistent batch: finished requests leave, new ones
        enter (each list in one call: an encoder-only step replaces ~100 requests), running
        ones advance."""
        batch, tables = self.input_batch, self.attn_metadata
        if self.lora is not None:
            self._release_loras(so.finished_req_ids)
        removed = batch.remove_requests(so.finished_req_ids)
        if removed:
            tables.clear_rows(np.array([state.slot for state in removed], dtype=np.int64))
            self.state.on_requests_removed(removed)
        new_reqs = so.scheduled_new_reqs
        if new_reqs:
            added = batch.add_requests(new_reqs)
            if self.lora is not None:
                self._acquire_loras(added, new_reqs)
            tables.set_rows([state.slot for state in added], [d.block_ids for d in new_reqs])
            self.state.on_requests_added(added, new_reqs)
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            requests = batch.requests
            slots = np.fromiter(
                (requests[r].slot for r in cached.req_ids), np.int64, len(cached.req_ids)
            )
            batch.num_computed_tokens[slots] = cached.num_computed_tokens
            for slot, blocks in zip(slots.tolist(), cached.new_block_ids, strict=True):
                if blocks is not None:
                    tables.append_rows(slot, blocks)

    def _acquire_loras(self, added: list[Any], new_reqs: list[Any]) -> None:
        """Each new request's adapter into a device slot. One the worker cannot read fails its
        requests alone: they stay in the batch on the base weights (slot -1) for this step,
        their rows are dropped and the scheduler ends them (`ModelRunnerOutput.failed`)."""
        from v1.lora import LoRALoadError

        batch = self.input_batch
        for state, data in zip(added, new_reqs, strict=True):
            if data.lora_request is None:
                continue
            try:
                batch.lora_slots[state.slot] = self.lora.acquire(data.lora_request)
            except LoRALoadError as e:
                logger.warning("request %s fails alone: %s", data.req_id, e)
                self.failed_requests[data.req_id] = str(e)
                continue
            self.lora_ids[data.req_id] = data.lora_request.lora_int_id

    def _release_loras(self, finished_req_ids: Any) -> None:
        for req_id in finished_req_ids:
            lora_id = self.lora_ids.pop(req_id, None)
            if lora_id is not None:
                self.lora.release(lora_id)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        requests = batch.requests
        slots = np.fromiter((requests[r].slot for r in req_ids), np.int64, len(req_ids))
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(req_ids))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])
        computed = batch.num_computed_tokens[slots]
        token_slots = np.repeat(slots, num_scheduled)
        # position of token t = computed[req] + (t - qsl[req])
        positions = np.repeat(computed - qsl[:-1], num_scheduled)
        positions += np.arange(num_tokens)
        seq_lens = computed + num_scheduled
        dst, src = batch.pending_inputs(slots, computed, seq_lens, qsl)
        token_index = batch.token_index(token_slots, positions)
        ids = batch.token_ids.reshape(-1).take(token_index)
        pad = padded_num_tokens(num_tokens) - num_tokens if pads_tokens(self.device) else 0
        if self.lora is not None:  # each token runs with its request's adapter
            self.lora.indices.set(False, batch.lora_slots[token_slots])
        zeros = np.zeros(pad, np.int64)
        # One pinned copy for the step's index arrays, padded ids and positions first:
        # [ids | 0s | positions | 0s | logits rows | dst | src]
        parts = [ids, zeros, positions, zeros, qsl[1:] - 1, dst, src]
        sizes = [num_tokens + pad, num_tokens + pad, len(req_ids), len(dst), len(src)]
        shipped = parts_to_device(parts, self.device, sizes)
        input_ids, positions_dev, logits_indices, dst_dev, src_dev = shipped
        if len(dst):
            # Tokens sampled by the step still running: read where they are, on the device.
            input_ids[dst_dev] = batch.pending_source()[src_dev]
        grammar_rows = None
        if so.structured_output_req_ids:
            row_of = {req_id: i for i, req_id in enumerate(req_ids)}
            grammar_rows = np.array([row_of[r] for r in so.structured_output_req_ids], np.int64)
        return StepInputs(
            grammar_rows=grammar_rows,
            grammar_bitmask=so.grammar_bitmask if grammar_rows is not None else None,
            req_ids=req_ids,
            slots=slots,
            num_scheduled=num_scheduled,
            query_start_loc=qsl,
            token_slots=token_slots,
            token_index=token_index,
            positions_np=positions,
            seq_lens=seq_lens,
            input_ids=input_ids,
            positions=positions_dev,
            logits_indices=logits_indices,
            reached_end=seq_lens >= batch.num_tokens[slots],
        )

    # ---- memory profiling (GPU) ----
    @torch.inference_mode()
    def profile_available_kv_bytes(self, utilization: float, baseline: MemoryBaseline) -> int:
        """Run a max-size dummy step (attention skipped: no cache yet), then give the KV cache
        `utilization` of the device memory minus this engine's measured peak and its own
        memory outside PyTorch since `baseline` (`gpu_memory.kv_cache_bytes`)."""
        # An engine shut down earlier in this process (tests, notebooks, benchmarks) may
        # still hold its KV cache in unreachable cycles: collect them before measuring.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.state.dummy_run(self.config.scheduler_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return kv_cache_bytes(
            utilization=utilization,
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(self.device),
            peak=torch.cuda.max_memory_allocated(self.device),
            baseline=baseline,
        )

    def shutdown(self) -> None:
        # Everything that holds the model lets it go (the state, the graphs' forward).
        self.model = None
        self.state = None
        self.cuda_graphs = None
        self.attn_layers = {}


class _WithFailed:
    """A step's deferred output that also reports the requests the runner failed alone."""

    def __init__(self, inner: DeferredRunnerOutput, failed: dict[str, str]) -> None:
        self.inner = inner
        self.failed = failed

    def get_output(self) -> ModelRunnerOutput:
        output = self.inner.get_output()
        output.failed = {**output.failed, **self.failed}
        return output
