"""Model-kind strategy interface, and the sampling half shared by the generating kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.core.sched_output import (
    DeferredRunnerOutput,
    ModelRunnerOutput,
    NewRequestData,
    ReadyRunnerOutput,
    SchedulerOutput,
)
from v1.forward_context import ForwardContext, set_forward_context
from v1.worker.input_batch import CachedRequestState
from v1.worker.prompt_logprobs import prompt_logprobs_job
from v1.worker.sampled_output import HostCopy, PendingSampledStep

if TYPE_CHECKING:
    from v1.model_info import ModelInfo
    from v1.worker.model_runner import ModelRunner, StepInputs


class ModelState:
    """What differs between decoder-only, encoder-decoder and encoder-only models."""

    def __init__(self, runner: ModelRunner, info: ModelInfo) -> None:
        self.runner = runner
        self.info = info
        """The process's model facts (special tokens, pooling config, classifier head)."""

    def on_model_loaded(self) -> None:
        return None

    def on_kv_cache_ready(self) -> None:
        return None

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        return None

    def on_request_removed(self, state: CachedRequestState) -> None:
        return None

    def execute(self, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def execute_async(self, step: StepInputs, so: SchedulerOutput) -> DeferredRunnerOutput:
        """Launch the step; its output is read back later (pipelined scheduling). Kinds that
        cannot defer run it whole now."""
        return ReadyRunnerOutput(self.execute(step, so))

    def dummy_run(self, num_tokens: int) -> None:
        """A max-size forward for memory profiling (attention skipped)."""
        runner = self.runner
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=runner.device)
        positions = torch.arange(num_tokens, device=runner.device) % runner.max_model_len
        with set_forward_context(ForwardContext(profiling=True)):
            hidden_states = self.forward_for_profile(input_ids, positions)
        if hasattr(runner.model, "compute_logits"):
            runner.model.compute_logits(hidden_states[: runner.max_num_reqs])

    def forward_for_profile(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.runner.model(input_ids, positions)


class GenerationState(ModelState):
    """Sampling state and the sample-and-append half of a generating step."""

    def whisper_token_info(self) -> Any:
        return None

    def on_kv_cache_ready(self) -> None:
        from v1.sample import Sampler, SamplingState

        runner = self.runner
        self.sampling_state = SamplingState(
            runner.max_num_reqs,
            runner.max_model_len,
            runner.model_config.vocab_size,
            runner.device,
            whisper=self.whisper_token_info(),
            seed=runner.model_config.seed,
        )
        self.sampler = Sampler()

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
        eos = getattr(self.runner.model_config.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def on_request_removed(self, state: CachedRequestState) -> None:
        self.sampling_state.remove_request(state.slot)

    def execute(self, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(step, so).get_output()

    def execute_async(self, step: StepInputs, so: SchedulerOutput) -> PendingSampledStep:
        """Launches the forward pass and the sampler; the sampled tokens stay on the device
        (they feed the next step there) and reach the host when the output is read."""
        pending = self.sample_async(self.forward(step, so), step)
        pending.num_encoder_runs = self.num_encoder_runs_in(so)
        return pending

    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        """Hidden states [T, H] of the step's packed tokens."""
        raise NotImplementedError

    def num_encoder_runs_in(self, so: SchedulerOutput) -> int:
        return 0

    def sample_async(
        self,
        hidden_states: torch.Tensor,
        step: StepInputs,
        extra_to_host: dict[str, torch.Tensor] | None = None,
    ) -> PendingSampledStep:
        runner = self.runner
        state = self.sampling_state
        prompt_job = prompt_logprobs_job(  # before this step's tokens count as outputs
            runner,
            step,
            state.num_prompt_logprobs,
            state.num_prompt_tokens,
            state.num_output_tokens,
            hidden_states,
        )
        logits = runner.model.compute_logits(hidden_states[step.logits_indices])
        logits = logits[:, : runner.model_config.vocab_size]
        metadata = self.sampling_state.make_metadata(step.slots)
        if step.grammar_rows is not None:
            from v1.sample.metadata import RowBitmask

            metadata.grammar_bitmask = RowBitmask(
                rows=runner._to_device(step.grammar_rows),
                bitmask=runner._to_device(step.grammar_bitmask),
            )
        out = self.sampler(logits, metadata)
        sampled = out.sampled_token_ids  # [R] int64, on the device
        keep_rows = np.flatnonzero(step.reached_end)
        kept_slots = step.slots[keep_rows]
        if len(keep_rows):
            if len(keep_rows) == len(step.slots):
                kept = sampled
            else:
                kept = sampled[runner._to_device(keep_rows)]
            self.sampling_state.append_output_tokens(kept_slots, kept)
        batch = runner.input_batch
        positions = batch.mark_pending(kept_slots, keep_rows)
        runner.prev_sampled_token_ids = sampled
        to_host = {"sampled": sampled}
        num_logprobs = None
        if out.logprobs is not None:
            to_host |= {"lp_ids": out.logprob_token_ids, "lp": out.logprobs, "ranks": out.ranks}
            num_logprobs = self.sampling_state.num_logprobs[step.slots]
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
