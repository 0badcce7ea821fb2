"""Model-kind strategy interface, what a strategy is built from (StateContext), and the sampling
half shared by the generating kinds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from v1 import envs
from v1.config import EngineConfig
from v1.core.sched_output import DeferredRunnerOutput, NewRequestData, SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.host_copy import to_device
from v1.models.interfaces import SupportsLogits, require
from v1.worker.attn_metadata import AttentionMetadataFactory
from v1.worker.input_batch import CachedRequestState, InputBatch
from v1.worker.prompt_logprobs import prompt_logprobs_job
from v1.worker.sampled_output import HostCopy, PendingSampledStep

if TYPE_CHECKING:
    from v1.worker.kv_cache_views import LayerCache
    from v1.worker.step_inputs import StepInputs


@dataclass(frozen=True)
class StateContext:
    """Everything a model-kind state works with (it never sees the runner)."""

    model: Any
    """The loaded model; the state checks the protocols it calls (v1/models/interfaces.py)."""
    input_batch: InputBatch
    attn_metadata: AttentionMetadataFactory
    device: torch.device
    config: EngineConfig
    lora: Any = None
    """The LoRAModelManager when LoRA is enabled: the state sets the encoder rows' adapter
    slots before running encoder rows (encoders, cross K/V projections)."""


class ModelState(ABC):
    """What differs between decoder-only, encoder-decoder and encoder-only models.

    A step is three calls from the runner: `prepare_step` (work outside the model's main
    pass: encoders, cross-K/V writes, input checks), the main pass (the runner replays a CUDA
    graph of `decode_forward` or calls `forward` eagerly), then `finish_step` (sampling or
    pooling, launched; the output is read back later)."""

    model_interfaces: ClassVar[tuple[type, ...]] = ()
    """Protocols the state calls on the model, checked when it is built (at model load)."""
    supports_cuda_graphs: ClassVar[bool] = False
    """Whether the state has a `decode_forward(input_ids, positions)`: the main pass over
    static buffers under the caller's forward context, which CUDA graphs capture."""

    def __init__(self, ctx: StateContext) -> None:
        require(ctx.model, self.model_interfaces, type(self).__name__)
        self.model = ctx.model
        self.input_batch = ctx.input_batch
        self.attn_metadata = ctx.attn_metadata
        self.device = ctx.device
        self.config = ctx.config
        self.lora = ctx.lora
        self.model_config = ctx.config.model_config
        self.info = self.model_config.info
        """The process's model facts (special tokens, pooling config, classifier head)."""
        self.max_num_reqs = ctx.input_batch.max_num_reqs
        self.max_model_len = ctx.input_batch.max_model_len

    def on_kv_cache_ready(self, kv_caches: dict[str, LayerCache]) -> None:
        """The KV cache exists (`kv_caches`: its views by layer name) and so do the block
        tables; steps follow."""
        return None

    def on_requests_added(
        self, states: list[CachedRequestState], new_reqs: list[NewRequestData]
    ) -> None:
        """A step's new requests (states[i] holds new_reqs[i]); a state whose work batches
        over them overrides this, others `on_request_added`."""
        for state, data in zip(states, new_reqs, strict=True):
            self.on_request_added(state, data)

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        return None

    def on_requests_removed(self, states: list[CachedRequestState]) -> None:
        for state in states:
            self.on_request_removed(state)

    def on_request_removed(self, state: CachedRequestState) -> None:
        return None

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # ---- the step ----
    def prepare_step(self, step: StepInputs, so: SchedulerOutput) -> None:
        return None

    @abstractmethod
    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        """The step's main pass, eagerly: hidden states [T, H] of its packed tokens."""

    @abstractmethod
    def finish_step(
        self, hidden_states: torch.Tensor, step: StepInputs, so: SchedulerOutput
    ) -> DeferredRunnerOutput:
        """Launches what turns the hidden states into the step's output."""

    # ---- memory profiling ----
    def dummy_run(self, num_tokens: int) -> None:
        """A max-size forward for memory profiling (attention skipped)."""
        self.profile_forward(num_tokens)

    @property
    def max_profile_position(self) -> int:
        """Positions of the profiling pass stay below this (the model's position limit)."""
        return self.max_model_len

    def profile_forward(self, num_tokens: int) -> torch.Tensor:
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_profile_position
        with set_forward_context(ForwardContext(profiling=True)):
            return self.model(input_ids, positions)


class GenerationState(ModelState):
    """Sampling state and the sample-and-append half of a generating step."""

    model_interfaces = (SupportsLogits,)
    supports_cuda_graphs = True

    def whisper_token_info(self) -> Any:
        return None

    def on_kv_cache_ready(self, kv_caches: dict[str, LayerCache]) -> None:
        from v1.sample import Sampler, SamplingState

        self.sampling_state = SamplingState(
            self.max_num_reqs,
            self.max_model_len,
            self.model_config.vocab_size,
            self.device,
            whisper=self.whisper_token_info(),
            seed=self.model_config.seed,
        )
        self.sampler = Sampler()
        self.sampler_graphs = None
        if self.uses_sampler_graphs:
            from v1.sample.graphed import SamplerGraphs

            self.sampler_graphs = SamplerGraphs(
                self.sampling_state,
                self.compute_logits,
                self.model_config.hf_config.hidden_size,
                self.model_config.torch_dtype(self.device.type),
                self.max_num_reqs,
            )
            self.sampler_graphs.capture_common(*self.common_sampler_signatures())

    @property
    def uses_sampler_graphs(self) -> bool:
        """CUDA graphs of the fixed-shape sampler (v1/sample/graphed.py): on CUDA unless
        enforce_eager, on one GPU. V1_SAMPLER_GRAPHS=0 turns them off; =1 also runs the
        fixed-shape sampler off CUDA (eagerly: tests)."""
        switch = envs.sampler_graphs()
        if switch is False or self.config.parallel_config.tensor_parallel_size != 1:
            return False
        return switch is True or (self.device.type == "cuda" and not self.config.enforce_eager)

    def common_sampler_signatures(self) -> tuple[list[int | None], list[bool]]:
        """(logprobs, timestamps) whose sampler graphs are captured at start-up."""
        return [None], [False]

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        self.sampling_state.add_request(
            state.slot,
            data.sampling_params,
            data.prompt_token_ids,
            data.output_token_ids,
            self.eos_token_id(data),
        )

    def eos_token_id(self, data: NewRequestData) -> int | None:
        if data.eos_token_id is not None:
            return data.eos_token_id
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def on_request_removed(self, state: CachedRequestState) -> None:
        self.sampling_state.remove_request(state.slot)

    def finish_step(
        self, hidden_states: torch.Tensor, step: StepInputs, so: SchedulerOutput
    ) -> PendingSampledStep:
        """Launches the sampler; the sampled tokens stay on the device (they feed the next
        step there) and reach the host when the output is read."""
        pending = self.sample_async(hidden_states, step)
        pending.num_encoder_runs = self.num_encoder_runs_in(so)
        return pending

    def num_encoder_runs_in(self, so: SchedulerOutput) -> int:
        return 0

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab_size] (heads padded past the vocabulary are cut)."""
        return self.model.compute_logits(hidden_states)[:, : self.model_config.vocab_size]

    def sample_async(
        self,
        hidden_states: torch.Tensor,
        step: StepInputs,
        extra_to_host: dict[str, torch.Tensor] | None = None,
    ) -> PendingSampledStep:
        state = self.sampling_state
        batch = self.input_batch
        prompt_job = prompt_logprobs_job(  # before this step's tokens count as outputs
            step,
            batch.token_ids,
            state.params.num_prompt_logprobs,
            state.num_prompt_tokens,
            state.num_output_tokens,
            hidden_states,
            self.compute_logits,
        )
        out = None
        if self.sampler_graphs is not None and prompt_job is None and step.grammar_rows is None:
            out = self.sampler_graphs.run(
                hidden_states, step.logits_indices, step.slots, step.reached_end
            )
        graphed = out is not None
        if out is None:
            logits = self.compute_logits(hidden_states[step.logits_indices])
            metadata = self.sampling_state.make_metadata(step.slots)
            if step.grammar_rows is not None:
                from v1.sample.metadata import RowBitmask

                metadata.grammar_bitmask = RowBitmask(
                    rows=self.to_device(step.grammar_rows),
                    bitmask=self.to_device(step.grammar_bitmask),
                )
            out = self.sampler(logits, metadata)
        sampled = out.sampled_token_ids  # [R] int64, on the device
        keep_rows = np.flatnonzero(step.reached_end)
        kept_slots = step.slots[keep_rows]
        if len(keep_rows) and graphed:
            self.sampling_state.count_output_tokens(kept_slots)
        elif len(keep_rows):
            if len(keep_rows) == len(step.slots):
                kept = sampled
            else:
                kept = sampled[self.to_device(keep_rows)]
            self.sampling_state.append_output_tokens(kept_slots, kept)
        positions = batch.mark_pending(kept_slots, keep_rows, sampled)
        to_host = {"sampled": sampled}
        num_logprobs = None
        if out.logprobs is not None:
            to_host |= {"lp_ids": out.logprob_token_ids, "lp": out.logprobs, "ranks": out.ranks}
            num_logprobs = self.sampling_state.params.num_logprobs[step.slots]
        to_host |= extra_to_host or {}
        if prompt_job is not None:
            to_host |= prompt_job[1]
        pending = PendingSampledStep(
            batch=batch,
            req_ids=step.req_ids,
            keep_rows=keep_rows,
            slots=kept_slots,
            generations=batch.slot_generations[kept_slots],
            positions=positions,
            host=HostCopy(to_host),
            num_logprobs=num_logprobs,
        )
        if prompt_job is not None:
            pending.finalize.append(prompt_job[0].finalize)
        return pending

    # ---- memory profiling ----
    def dummy_run(self, num_tokens: int) -> None:
        hidden_states = self.profile_forward(num_tokens)
        self.model.compute_logits(hidden_states[: self.max_num_reqs])
