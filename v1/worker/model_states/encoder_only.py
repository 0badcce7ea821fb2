"""Encoder-only models (BERT, RoBERTa/XLM-R, cross-encoders): each request's whole input runs
in one bidirectional pass over the packed batch (no KV blocks), then is pooled by its
PoolingParams; the step's output is one float32 array per request and the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from v1.attention.backend import AttentionType
from v1.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.models.layers.pooler import PendingPooledOutput, Pooler, PoolingSegments
from v1.worker.input_batch import CachedRequestState
from v1.worker.model_states.base import ModelState

if TYPE_CHECKING:
    from v1.worker.model_runner import StepInputs


@dataclass
class PendingPoolingStep:
    """A launched encoder-only step (a DeferredRunnerOutput)."""

    req_ids: list[str]
    pooled: PendingPooledOutput

    def get_output(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[] for _ in self.req_ids],
            pooler_output=self.pooled.result(),
        )


class EncoderOnlyState(ModelState):
    def on_model_loaded(self) -> None:
        runner = self.runner
        self.pooling_config = self.info.pooling
        assert self.pooling_config is not None
        classify = runner.model.classify if self.info.has_classifier else None
        self.pooler = Pooler(self.pooling_config, classify)
        self.layer_names = runner.layers_of_type(AttentionType.ENCODER_ONLY)
        self.max_input_len = runner.model_config.max_encoder_len
        """The position-embedding limit (the frontend may hold inputs to less)."""

    def on_kv_cache_ready(self) -> None:
        runner = self.runner
        # Segment ids per slot, gathered per step like the token ids (0 where a request has none).
        self.token_type_ids = np.zeros((runner.max_num_reqs, runner.max_model_len), dtype=np.int64)

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        if data.pooling_params is None:
            raise ValueError(f"request {data.req_id}: an encoder-only model needs pooling_params")
        row = self.token_type_ids[state.slot]
        row[:] = 0
        if data.token_type_ids is not None:
            if len(data.token_type_ids) != len(data.prompt_token_ids):
                raise ValueError(
                    f"request {data.req_id}: {len(data.token_type_ids)} token_type_ids for "
                    f"{len(data.prompt_token_ids)} tokens"
                )
            row[: len(data.token_type_ids)] = data.token_type_ids

    def execute(self, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(step, so).get_output()

    def execute_async(self, step: StepInputs, so: SchedulerOutput) -> PendingPoolingStep:
        """Enqueues the forward, the pooling and the copy of the results; no host sync."""
        runner = self.runner
        batch = runner.input_batch
        lengths = step.num_scheduled
        assert (batch.num_computed_tokens[step.slots] == 0).all() and step.reached_end.all(), (
            "encoder-only requests run whole in one step"
        )
        self._check_inputs(step)
        # Checked at the edge and at the core boundary (EngineCore admission).
        params = [batch.requests[r].pooling_params for r in step.req_ids]
        metadata = runner.uncached_attn_metadata(
            lengths, AttentionType.ENCODER_ONLY, self.layer_names
        )
        token_type_ids = runner._to_device(self.token_type_ids[step.token_slots, step.positions_np])
        with set_forward_context(ForwardContext(metadata)):
            hidden_states = runner.model(
                step.input_ids, step.positions, token_type_ids=token_type_ids
            )  # [T, hidden]
        segments = PoolingSegments.from_lengths(lengths, runner.device)
        return PendingPoolingStep(step.req_ids, self.pooler.launch(hidden_states, segments, params))

    def _check_inputs(self, step: StepInputs) -> None:
        too_long = step.num_scheduled > self.max_input_len
        if too_long.any():
            names = [
                f"{r} ({n} tokens)"
                for r, n, bad in zip(
                    step.req_ids, step.num_scheduled.tolist(), too_long, strict=True
                )
                if bad
            ]
            raise ValueError(
                f"inputs longer than the model's limit of {self.max_input_len} positions: "
                f"{', '.join(names)}"
            )
