"""ModelRunner: applies SchedulerOutput deltas to the persistent batch, builds step inputs and
attention metadata (vectorized), and hands the step to the model-kind strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.attention.cross_attention import (
    ENCODER_STATES_LAYER,
    EncoderDecoderAttention,
    encoder_states_builder_cls,
)
from v1.attention.layer import Attention
from v1.attention.selector import default_backend_name, load_backend, use_backend
from v1.config import EngineConfig, ModelKind
from v1.core.sched_output import (
    DeferredRunnerOutput,
    ModelRunnerOutput,
    ReadyRunnerOutput,
    SchedulerOutput,
)
from v1.host_copy import to_device
from v1.kv_cache.spec import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EncoderStatesSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    encoder_states_spec_in_pool,
)
from v1.worker.block_table import BlockTable
from v1.worker.input_batch import InputBatch
from v1.worker.kv_cache_views import KVBlockCopier, LayerCache, allocate_kv_cache


@dataclass
class StepInputs:
    """One step's packed decoder (or encoder-only) inputs, requests in batch order."""

    req_ids: list[str]
    slots: np.ndarray
    num_scheduled: np.ndarray
    query_start_loc: np.ndarray
    """[R + 1] token offsets."""
    token_slots: np.ndarray
    """[T] slot of each token."""
    positions_np: np.ndarray
    seq_lens: np.ndarray
    """[R] tokens in the sequence after this step."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    """[R] index of each request's last scheduled token."""
    reached_end: np.ndarray
    """[R] bool: the step reaches the end of the request's known tokens (a token is sampled)."""
    grammar_rows: np.ndarray | None = None
    """[k] batch rows whose next token a grammar constrains (structured outputs)."""
    grammar_bitmask: np.ndarray | None = None
    """[k, ceil(vocab / 32)] int32 packed masks of those rows (SchedulerOutput.grammar_bitmask)."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.dtype = self.model_config.torch_dtype(device.type)
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_model_len = self.model_config.effective_max_model_len
        self.block_size = config.cache_config.block_size
        needs_bias = self.model_config.hf_config.model_type in ("t5", "mt5", "umt5")
        fp8_kv_cache = config.cache_config.fp8_kv_cache
        self.backend_name = default_backend_name(
            device.type, self.block_size, needs_bias, fp8_kv_cache
        )
        self.kv_cache_dtype = (
            "float8_e4m3fn" if fp8_kv_cache else str(self.dtype).removeprefix("torch.")
        )
        """KV cache spec dtype (fp8 caches keep float32 scales beside their rows)."""
        self.backend = load_backend(self.backend_name)
        self.model: Any = None
        self.tp: Any = None
        """This rank's TensorParallelGroup (set by the worker; None: the whole model here)."""
        self.attn_layers: dict[str, Attention] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.input_batch: InputBatch | None = None
        self.cuda_graphs: Any = None
        self.prev_sampled_token_ids: torch.Tensor | None = None
        """[R] tokens sampled by the last launched step, on the device (pipelined steps)."""
        mode = config.cache_config.cross_attention
        self.cross_attention = "absorbed" if mode == "absorbed" else "per_layer"
        """per_layer or absorbed (the worker resolves "auto" before sizing the cache)."""
        self.encoder_states: LayerCache | None = None
        """The encoder-states cache (absorbed cross-attention)."""
        self.state = _make_state(self.model_config.kind, self)

    # ---- set-up ----
    def load_model(self) -> None:
        from v1.models.loader import load_model

        with use_backend(self.backend_name):
            self.model = load_model(self.model_config, self.device, self.dtype, tp=self.tp)
        self.model.eval()
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        self.set_cross_attention(self.cross_attention)
        self.state.on_model_loaded()

    def set_cross_attention(self, mode: str) -> None:
        """per_layer or absorbed, for the cross-attention layers too; before the cache exists
        (its layout depends on it; a memory profile runs the mode's activations)."""
        assert mode in ("per_layer", "absorbed") and self.kv_cache_config is None, mode
        self.cross_attention = mode
        for layer in self.attn_layers.values():
            if isinstance(layer, EncoderDecoderAttention):
                layer.absorbed = mode == "absorbed"

    @property
    def has_cross_attention(self) -> bool:
        return any(isinstance(m, EncoderDecoderAttention) for m in self.attn_layers.values())

    def get_kv_cache_specs(self, cross_attention: str | None = None) -> dict[str, KVCacheSpec]:
        """Layer name -> spec; absorbed cross-attention (default: the runner's mode) replaces
        the cross layers' specs by the one encoder-states pseudo-layer."""
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
        if (cross_attention or self.cross_attention) == "absorbed" and self.has_cross_attention:
            pool_spec = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
            specs = {n: s for n, s in specs.items() if not isinstance(s, CrossAttentionSpec)}
            d_model = self.model_config.hf_config.d_model
            specs[ENCODER_STATES_LAYER] = encoder_states_spec_in_pool(pool_spec, d_model)
        return specs

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        views = allocate_kv_cache(kv_cache_config, self.device)
        self.copy_blocks = KVBlockCopier(kv_cache_config, views)
        for name, cache in views.items():
            if name == ENCODER_STATES_LAYER:
                self.encoder_states = cache
                for layer in self.attn_layers.values():
                    if isinstance(layer, EncoderDecoderAttention):
                        layer.bind_encoder_states(cache.values, cache.scales)
            else:
                self.attn_layers[name].kv_cache = cache.values
                self.attn_layers[name].kv_scales = cache.scales
        self.group_layers: list[tuple[str, ...]] = []
        self.group_types: list[AttentionType] = []
        self.builders = []
        tables = []
        for group in kv_cache_config.groups:
            spec = group.spec
            is_cross = isinstance(spec, (CrossAttentionSpec, EncoderStatesSpec))
            attn_type = AttentionType.ENCODER_DECODER if is_cross else AttentionType.DECODER
            max_len = self.model_config.max_encoder_len if is_cross else self.max_model_len
            tables.append(
                BlockTable(self.max_num_reqs, -(-max_len // spec.block_size), spec.block_size)
            )
            self.group_layers.append(group.layer_names)
            self.group_types.append(attn_type)
            builder_cls = (
                encoder_states_builder_cls(self.backend_name)
                if isinstance(spec, EncoderStatesSpec)
                else self.backend.get_builder_cls()
            )
            self.builders.append(builder_cls(attn_type, self.device, spec.block_size))
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, tables)
        self.state.on_kv_cache_ready()
        self.cuda_graphs = None
        if self.use_cuda_graphs:
            from v1.worker.cuda_graphs import CudaGraphManager

            self.cuda_graphs = CudaGraphManager.create(self)
            self.cuda_graphs.capture()

    @property
    def use_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.backend_name == "triton"
            and self.model_config.kind != ModelKind.ENCODER_ONLY
        )

    # ---- the step ----
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        """Launches the step without waiting for it (pipelined scheduling): everything here
        is enqueued on the device stream, so the next step can be prepared meanwhile."""
        self._update_states(scheduler_output)
        self.copy_blocks(scheduler_output.block_copies)  # forks: before any step reads them
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ReadyRunnerOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        step = self._prepare_inputs(scheduler_output)
        return self.state.execute_async(step, scheduler_output)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            state = batch.remove_request(req_id)
            if state is not None:
                self.state.on_request_removed(state)
        for data in so.scheduled_new_reqs:
            state = batch.add_request(data)
            self.state.on_request_added(state, data)
        cached = so.scheduled_cached_reqs
        if cached.req_ids:
            requests = batch.requests
            slots = np.fromiter(
                (requests[r].slot for r in cached.req_ids), np.int64, len(cached.req_ids)
            )
            batch.num_computed_tokens[slots] = cached.num_computed_tokens
            for slot, blocks in zip(slots.tolist(), cached.new_block_ids, strict=True):
                if blocks is not None:
                    batch.append_blocks(slot, blocks)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        slots = np.array([batch.requests[r].slot for r in req_ids], dtype=np.int64)
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])
        computed = batch.num_computed_tokens[slots]
        token_slots = np.repeat(slots, num_scheduled)
        # position of token t = computed[req] + (t - qsl[req])
        positions = np.repeat(computed - qsl[:-1], num_scheduled) + np.arange(num_tokens)
        seq_lens = computed + num_scheduled
        dst, src = batch.pending_inputs(slots, computed, seq_lens, qsl)
        # One pinned copy for the step's index arrays: [ids | positions | logits rows | dst | src]
        parts = [batch.token_ids[token_slots, positions], positions, qsl[1:] - 1, dst, src]
        shipped = self._to_device(np.concatenate(parts)).split([len(p) for p in parts])
        input_ids, positions_dev, logits_indices, dst_dev, src_dev = shipped
        if len(dst):
            # Tokens sampled by the step still running: read where they are, on the device.
            assert self.prev_sampled_token_ids is not None
            input_ids[dst_dev] = self.prev_sampled_token_ids[src_dev]
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
            positions_np=positions,
            seq_lens=seq_lens,
            input_ids=input_ids,
            positions=positions_dev,
            logits_indices=logits_indices,
            reached_end=seq_lens >= batch.num_tokens[slots],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # ---- attention metadata ----
    def make_common(
        self,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        causal: bool,
        block_table: torch.Tensor | None = None,
        slot_mapping: np.ndarray | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> CommonAttentionMetadata:
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_cpu = torch.from_numpy(np.ascontiguousarray(seq_lens, dtype=np.int32))
        num_reqs = len(seq_lens)
        query_lens = np.diff(query_start_loc)
        return CommonAttentionMetadata(
            # non_blocking: a blocking host-to-device copy would wait for the whole stream.
            query_start_loc=to_device(qsl_cpu, self.device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=to_device(seq_cpu, self.device),
            seq_lens_cpu=seq_cpu,
            num_reqs=num_reqs,
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            causal=causal,
            block_table=block_table,
            slot_mapping=self._to_device(slot_mapping) if slot_mapping is not None else None,
            query_positions=query_positions,
        )

    def decoder_attn_metadata(self, step: StepInputs) -> dict[str, Any]:
        """Metadata of every decoder self-attention group (one object per group)."""
        out: dict[str, Any] = {}
        for i, attn_type in enumerate(self.group_types):
            if attn_type != AttentionType.DECODER:
                continue
            table = self.input_batch.block_tables[i]
            common = self.make_common(
                step.query_start_loc,
                step.seq_lens,
                causal=True,
                block_table=table.rows(step.slots, self.device),
                slot_mapping=table.slot_mapping(step.token_slots, step.positions_np),
                query_positions=step.positions,
            )
            metadata = self.builders[i].build(common)
            out.update(dict.fromkeys(self.group_layers[i], metadata))
        return out

    def uncached_attn_metadata(
        self, lengths: np.ndarray, attn_type: AttentionType, layer_names: list[str]
    ) -> dict[str, Any]:
        """Bidirectional metadata over packed sequences with no cache (ENCODER, ENCODER_ONLY)."""
        qsl = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=qsl[1:])
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], lengths)
        common = self.make_common(
            qsl, lengths, causal=False, query_positions=self._to_device(positions)
        )
        metadata = self.backend.get_builder_cls()(attn_type, self.device, self.block_size).build(
            common
        )
        return dict.fromkeys(layer_names, metadata)

    def layers_of_type(self, attn_type: AttentionType) -> list[str]:
        return [n for n, layer in self.attn_layers.items() if layer.attn_type == attn_type]

    # ---- memory profiling (GPU) ----
    @torch.inference_mode()
    def profile_available_kv_bytes(self, utilization: float) -> int:
        """Run a max-size dummy step (attention skipped: no cache yet), then give the KV cache
        `utilization` of the device memory minus the measured peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.state.dummy_run(self.config.scheduler_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory held outside PyTorch's allocator (CUDA context, other processes).
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        available = int(total * utilization) - peak - max(non_torch, 0)
        if available <= 0:
            raise ValueError(
                f"no memory left for the KV cache: peak {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB at gpu_memory_utilization={utilization}; lower "
                "max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return available

    def shutdown(self) -> None:
        self.model = None
        self.attn_layers = {}


def _make_state(kind: ModelKind, runner: ModelRunner) -> Any:
    if kind == ModelKind.DECODER_ONLY:
        from v1.worker.model_states.decoder_only import DecoderOnlyState

        return DecoderOnlyState(runner)
    if kind == ModelKind.ENCODER_DECODER and runner.model_config.is_whisper:
        from v1.worker.model_states.whisper import WhisperState

        return WhisperState(runner)
    if kind == ModelKind.ENCODER_DECODER:
        from v1.worker.model_states.encoder_decoder import EncoderDecoderState

        return EncoderDecoderState(runner)
    from v1.worker.model_states.encoder_only import EncoderOnlyState

    return EncoderOnlyState(runner)
