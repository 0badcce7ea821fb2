"""Encoder-decoder models (BART, T5, Whisper): the encoder runs once per distinct input,
its output is kept by content hash; on a request's first step the cross-attention layers
project it into the request's cross blocks, later steps only read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.attention.backend import AttentionType
from v1.attention.cross_attention import ENCODER_STATES_LAYER
from v1.attention.ops.absorbed_cross_attention import write_encoder_states
from v1.core.protocol import EncoderInput
from v1.core.sched_output import SchedulerOutput
from v1.forward_context import ForwardContext, set_forward_context
from v1.models.interfaces import SupportsEncode, SupportsLogits
from v1.worker.model_states.base import GenerationState, StateContext
from v1.worker.step_inputs import padded_num_tokens, pads_tokens

if TYPE_CHECKING:
    from v1.worker.kv_cache_views import LayerCache
    from v1.worker.step_inputs import StepInputs


class EncoderDecoderState(GenerationState):
    model_interfaces = (SupportsLogits, SupportsEncode)

    def __init__(self, ctx: StateContext) -> None:
        super().__init__(ctx)
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        """content hash -> encoder output [num_encoder_tokens, hidden] (the encoder cache)."""
        self.encoder_layers = self.attn_metadata.layers_of_type(AttentionType.ENCODER)
        self.num_encoder_runs = 0
        self.encoder_states: LayerCache | None = None
        """The encoder-states cache (absorbed cross-attention), once the KV cache exists."""

    def on_kv_cache_ready(self, kv_caches: dict[str, LayerCache]) -> None:
        super().on_kv_cache_ready(kv_caches)
        self.encoder_states = kv_caches.get(ENCODER_STATES_LAYER)

    def prepare_step(self, step: StepInputs, so: SchedulerOutput) -> None:
        """The pre-step: encoders of new inputs, then cross K/V of requests on their first
        step. Every cross K/V of the step is in the cache afterwards: the decoder pass only
        reads it, so first steps replay CUDA graphs like any other decode step."""
        for content_hash in so.free_encoder_hashes:
            self.encoder_outputs.pop(content_hash, None)
        self._run_encoders(so.encoder_hashes_to_run)
        if so.encoder_reqs:
            self._write_cross_kv(step, so.encoder_reqs)

    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        metadata = self.attn_metadata.decoder(step)
        metadata.update(self._cross_attn_metadata(step, []))
        with set_forward_context(ForwardContext(metadata)):
            return self.decode_forward(step.input_ids, step.positions)

    def num_encoder_runs_in(self, so: SchedulerOutput) -> int:
        return len(so.encoder_hashes_to_run)

    def _write_cross_kv(self, step: StepInputs, encoder_reqs: list[str]) -> None:
        """The cross-K/V pre-step: project the encoder outputs of requests on their first step
        into their cross blocks. The model runs on one placeholder token per writer with every
        attention layer skipped (ForwardContext.cross_kv_only), so only the cross-attention
        K/V projections and cache writes do real work. Absorbed cross-attention stores the
        encoder outputs themselves instead, without running the model."""
        requests = self.input_batch.requests
        encoder_hidden_states = torch.cat(
            [self.encoder_outputs[requests[r].encoder_input.content_hash] for r in encoder_reqs]
        )
        self._set_encoder_lora(encoder_reqs)
        metadata = self._cross_attn_metadata(step, encoder_reqs)
        if self.encoder_states is not None:
            # Absorbed cross-attention: E itself is the cache, written once for all layers.
            write_encoder_states(
                encoder_hidden_states,
                self.encoder_states.values,
                self.encoder_states.scales,
                metadata[ENCODER_STATES_LAYER].common.slot_mapping,
            )
            return
        placeholder = torch.zeros(len(encoder_reqs), dtype=torch.long, device=self.device)
        with set_forward_context(ForwardContext(metadata, cross_kv_only=True)):
            self.model(placeholder, placeholder, encoder_hidden_states=encoder_hidden_states)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decoder step whose cross K/V are all in the cache already (what CUDA graphs run)."""
        return self.model(input_ids, positions, encoder_hidden_states=None)

    # ---- encoder ----
    def _run_encoders(self, hashes_to_run: dict[str, str]) -> int:
        if not hashes_to_run:
            return 0
        requests = self.input_batch.requests
        inputs = [requests[req_id].encoder_input for req_id in hashes_to_run.values()]
        lengths = np.array([e.num_encoder_tokens for e in inputs], dtype=np.int64)
        self._set_encoder_lora(list(hashes_to_run.values()))
        output = self._encode(inputs, lengths)[: int(lengths.sum())]
        for content_hash, part in zip(hashes_to_run, output.split(lengths.tolist()), strict=True):
            self.encoder_outputs[content_hash] = part
        self.num_encoder_runs += len(inputs)
        return len(inputs)

    def _encode(self, inputs: list[EncoderInput], lengths: np.ndarray) -> torch.Tensor:
        """The encoder over `inputs` ([lengths] tokens each) -> [sum(lengths) (+pad), H]."""
        metadata = self.attn_metadata.uncached(lengths, AttentionType.ENCODER, self.encoder_layers)
        with set_forward_context(ForwardContext(metadata)):
            return self.model.encode(**self._encoder_kwargs(inputs))

    def _set_encoder_lora(self, req_ids: list[str]) -> None:
        """Encoder rows of `req_ids` (packed in that order) run with each request's adapter."""
        if self.lora is None:
            return
        batch = self.input_batch
        states = [batch.requests[r] for r in req_ids]
        slots = batch.lora_slots[[s.slot for s in states]]
        lengths = [s.encoder_input.num_encoder_tokens for s in states]
        self.lora.indices.set(True, np.repeat(slots, lengths))

    def _encoder_kwargs(self, inputs: list[EncoderInput]) -> dict[str, Any]:
        if inputs[0].audio is not None:
            return {"audio": _audio_to_device([e.audio for e in inputs], self.device)}
        lengths = np.array([len(e.token_ids) for e in inputs], dtype=np.int64)
        ids = np.concatenate([np.asarray(e.token_ids, dtype=np.int64) for e in inputs])
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = np.arange(len(ids)) - starts
        if pads_tokens(self.device):  # repeating GEMM shapes (see padded_num_tokens)
            pad = np.zeros(padded_num_tokens(len(ids)) - len(ids), dtype=np.int64)
            ids, positions = np.concatenate([ids, pad]), np.concatenate([positions, pad])
        return {"input_ids": self.to_device(ids), "positions": self.to_device(positions)}

    # ---- cross-attention ----
    def _cross_attn_metadata(self, step: StepInputs, encoder_reqs: list[str]) -> dict[str, Any]:
        """Cross-attention metadata of the step; `encoder_reqs` write their cross blocks."""
        batch = self.input_batch
        writer_slots = np.array([batch.requests[r].slot for r in encoder_reqs], dtype=np.int64)
        return self.attn_metadata.cross(
            step,
            batch.num_encoder_tokens[step.slots],
            writer_slots,
            batch.num_encoder_tokens[writer_slots],
        )


def _audio_to_device(clips: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The step's 1-D float32 clips on `device`, moved in ONE copy: packed into one host buffer
    (pinned on CUDA), sent with one non-blocking transfer, split on the device (views).

    The caching host allocator keeps the pinned buffer from reuse until the copy is done.
    """
    lengths = [c.shape[0] for c in clips]
    host = torch.empty(sum(lengths), dtype=torch.float32, pin_memory=device.type == "cuda")
    np.concatenate(clips, out=host.numpy())  # the one host copy; casts other float dtypes
    return list(host.to(device, non_blocking=True).split(lengths))
