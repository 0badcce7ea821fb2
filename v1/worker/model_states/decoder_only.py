"""Decoder-only models: one causal pass over the packed batch, then sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.worker.model_states.base import GenerationState

if TYPE_CHECKING:
    from v1.worker.model_runner import StepInputs


class DecoderOnlyState(GenerationState):
    def execute(self, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        metadata = self.runner.decoder_attn_metadata(step)
        with set_forward_context(ForwardContext(metadata)):
            hidden_states = self.runner.model(step.input_ids, step.positions)
        return self.sample(hidden_states, step)
