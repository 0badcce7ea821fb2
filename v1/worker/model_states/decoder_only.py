"""Decoder-only models: one causal pass over the packed batch, then sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from v1.core.sched_output import SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.worker.model_states.base import GenerationState

if TYPE_CHECKING:
    from v1.worker.step_inputs import StepInputs


class DecoderOnlyState(GenerationState):
    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        metadata = self.attn_metadata.decoder(step)
        with set_forward_context(ForwardContext(metadata)):
            return self.decode_forward(step.input_ids, step.positions)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)
