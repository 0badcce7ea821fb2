"""Encoder-only models (BERT, RoBERTa/XLM-R, cross-encoders): each request's whole input runs
in one bidirectional pass over the packed batch (no KV blocks), then is pooled by its
PoolingParams; the step's output is one float32 array per request and the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from v1.attention.backend import AttentionType
from v1.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.models.interfaces import SupportsClassify, require
from v1.models.layers.pooler import PendingPooledOutput, Pooler, PoolingSegments
from v1.pooling_params import PoolingParams
from v1.worker.encoder_graphs import EncoderGraphs, make_encoder_graphs
from v1.worker.input_batch import CachedRequestState
from v1.worker.model_states.base import ModelState, StateContext

if TYPE_CHECKING:
    from v1.worker.kv_cache_views import LayerCache
    from v1.worker.step_inputs import StepInputs


@dataclass
class PendingPoolingStep:
    """A launched encoder-only step (a DeferredRunnerOutput)."""

    req_ids: list[str]
    pooled: PendingPooledOutput
    packed: list[int] | None = None
    """Per request: its packed inputs' count, or 0 for an unpacked one (its result stays one
    row); None: no request of the step packs inputs."""

    def get_output(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[] for _ in self.req_ids],
            pooler_output=self.pooled.result(self.packed),
        )


class EncoderOnlyState(ModelState):
    def __init__(self, ctx: StateContext) -> None:
        super().__init__(ctx)
        pooling_config = self.info.pooling
        assert pooling_config is not None, "an encoder-only model has a pooling config"
        self.pooling_config = pooling_config
        classify = None
        if self.info.has_classifier:
            require(self.model, (SupportsClassify,), f"{type(self).__name__} (a classifier)")
            classify = self.model.classify
        self.pooler = Pooler(self.pooling_config, classify)
        self.layer_names = self.attn_metadata.layers_of_type(AttentionType.ENCODER_ONLY)
        self.max_input_len = self.model_config.max_encoder_len
        """The position-embedding limit (the frontend may hold inputs to less)."""

    def on_kv_cache_ready(self, kv_caches: dict[str, LayerCache]) -> None:
        # Segment ids per slot, gathered per step like the token ids (0 where a request has none).
        self.token_type_ids = np.zeros((self.max_num_reqs, self.max_model_len), dtype=np.int64)
        self.has_token_types = np.zeros(self.max_num_reqs, dtype=bool)
        """Per slot: whether its request has a non-zero segment id (a text pair); a step of
        none ships no segment ids (the model adds segment 0's row)."""
        self.input_lens: list[np.ndarray | None] = [None] * self.max_num_reqs
        """Per slot: the lengths of its request's packed inputs (None: one input)."""
        self.num_packed = np.zeros(self.max_num_reqs, dtype=np.int64)
        """Per slot: its request's packed inputs (0: not packed), so a step of none is told
        by one vectorized read."""
        self.graphs: EncoderGraphs | None = None
        if not self.config.enforce_eager:
            self.graphs = make_encoder_graphs(
                self.model,
                self.attn_metadata,
                self.layer_names,
                self.device,
                self.config.scheduler_config.max_num_batched_tokens,
                self.max_num_reqs,
                self.max_input_len,
            )

    def on_requests_added(
        self, states: list[CachedRequestState], new_reqs: list[NewRequestData]
    ) -> None:
        """Checks the new requests and writes their segment-id rows: every row zeroed in one
        write, then the rows of requests with non-zero ids (text pairs) filled."""
        with_types: list[tuple[CachedRequestState, NewRequestData]] = []
        for state, data in zip(states, new_reqs, strict=True):
            if data.pooling_params is None:
                raise ValueError(
                    f"request {data.req_id}: an encoder-only model needs pooling_params"
                )
            if data.token_type_ids is not None:
                with_types.append((state, data))
            lens = data.input_lens
            self.input_lens[state.slot] = None if lens is None else np.array(lens, np.int64)
            self.num_packed[state.slot] = 0 if lens is None else len(lens)
        slots = np.fromiter((state.slot for state in states), np.int64, len(states))
        self.token_type_ids[slots] = 0
        self.has_token_types[slots] = False
        for state, data in with_types:
            types = data.token_type_ids
            if len(types) != len(data.prompt_token_ids):
                raise ValueError(
                    f"request {data.req_id}: {len(types)} token_type_ids for "
                    f"{len(data.prompt_token_ids)} tokens"
                )
            if any(types):  # all zeros (a text's, usually): the row already is
                self.token_type_ids[state.slot, : len(types)] = types
                self.has_token_types[state.slot] = True

    @property
    def max_profile_position(self) -> int:
        # RoBERTa's positions start past padding_idx: its limit is below max_model_len.
        return self.max_input_len

    def prepare_step(self, step: StepInputs, so: SchedulerOutput) -> None:
        """Checks the step's inputs before the forward pass (pooling parameters are checked at
        the edge and at the core boundary, EngineCore admission)."""
        assert (self.input_batch.num_computed_tokens[step.slots] == 0).all() and (
            step.reached_end.all()
        ), "encoder-only requests run whole in one step"
        self._split_packed(step)
        self._check_inputs(step)

    def _split_packed(self, step: StepInputs) -> None:
        """A step with packed requests runs each packed input as its own sequence: the step's
        `input_lens` list every input, and positions restart at 0 at each one."""
        counts = self.num_packed[step.slots]
        if not counts.any():
            return
        lens = [self.input_lens[slot] for slot in step.slots.tolist()]
        step.input_lens = np.concatenate(
            [n if n is not None else step.num_scheduled[i : i + 1] for i, n in enumerate(lens)]
        )
        step.input_counts = counts.tolist()
        starts = np.cumsum(step.input_lens) - step.input_lens
        positions = np.arange(step.num_tokens) - np.repeat(starts, step.input_lens)
        step.positions_np = positions
        step.positions[: step.num_tokens].copy_(self.to_device(positions))

    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        """One bidirectional pass over the packed inputs -> hidden states [T, hidden]. A step
        whose requests all have segment 0 (texts, not pairs) gathers and ships no segment ids:
        the model adds segment 0's row (saves a host gather and copy of T ids a step)."""
        token_types = None
        if self.has_token_types[step.slots].any():
            token_types = self.token_type_ids.reshape(-1).take(step.token_index)
        if self.graphs is not None and self.graphs.fits(step.num_tokens):
            types = None if token_types is None else self.to_device(token_types)
            return self.graphs.run(step.input_ids, step.positions, types, step.input_offsets)
        metadata = self.attn_metadata.uncached(
            step.sequence_lens, AttentionType.ENCODER_ONLY, self.layer_names
        )
        token_type_ids = None
        if token_types is not None:
            pad = len(step.input_ids) - len(token_types)  # padded eager CUDA step
            if pad:
                token_types = np.concatenate([token_types, np.zeros(pad, token_types.dtype)])
            token_type_ids = self.to_device(token_types)
        with set_forward_context(ForwardContext(metadata)):
            return self.model(step.input_ids, step.positions, token_type_ids=token_type_ids)

    def finish_step(
        self, hidden_states: torch.Tensor, step: StepInputs, so: SchedulerOutput
    ) -> PendingPoolingStep:
        """Enqueues the pooling and the copy of the results; no host sync."""
        segments = PoolingSegments.from_lengths(step.sequence_lens, self.device)
        pooled = self.pooler.launch(hidden_states, segments, self._pooling_params(step))
        return PendingPoolingStep(step.req_ids, pooled, step.input_counts)

    def _pooling_params(self, step: StepInputs) -> list[PoolingParams]:
        """Per sequence (each packed input repeats its request's)."""
        requests = self.input_batch.requests
        params = [requests[r].pooling_params for r in step.req_ids]
        if step.input_counts is None:
            return params
        return [p for p, k in zip(params, step.input_counts, strict=True) for _ in range(k or 1)]

    def _check_inputs(self, step: StepInputs) -> None:
        lens = step.sequence_lens
        too_long = lens > self.max_input_len
        if too_long.any():
            owners = step.req_ids
            if step.input_counts is not None:
                owners = [
                    r for r, k in zip(owners, step.input_counts, strict=True) for _ in range(k or 1)
                ]
            names = [
                f"{r} ({n} tokens)"
                for r, n, bad in zip(owners, lens.tolist(), too_long, strict=True)
                if bad
            ]
            raise ValueError(
                f"inputs longer than the model's limit of {self.max_input_len} positions: "
                f"{', '.join(names)}"
            )
