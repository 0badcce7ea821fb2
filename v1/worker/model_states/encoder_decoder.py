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
from v1.worker.model_states.base import GenerationState

if TYPE_CHECKING:
    from v1.worker.model_runner import StepInputs


class EncoderDecoderState(GenerationState):
    def on_model_loaded(self) -> None:
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        """content hash -> encoder output [num_encoder_tokens, hidden] (the encoder cache)."""
        self.encoder_layers = self.runner.layers_of_type(AttentionType.ENCODER)
        self.num_encoder_runs = 0

    def forward(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor:
        for content_hash in so.free_encoder_hashes:
            self.encoder_outputs.pop(content_hash, None)
        self._run_encoders(so.encoder_hashes_to_run)
        if so.encoder_reqs:
            self._write_cross_kv(step, so.encoder_reqs)
        # Every cross K/V of this step is in the cache now: the decoder step only reads it,
        # so first steps replay CUDA graphs like any other decode step.
        graphs = self.runner.cuda_graphs
        if graphs is not None and graphs.can_run(step, so):
            return graphs.run(step)
        metadata = self.runner.decoder_attn_metadata(step)
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
        runner = self.runner
        requests = runner.input_batch.requests
        encoder_hidden_states = torch.cat(
            [self.encoder_outputs[requests[r].encoder_input.content_hash] for r in encoder_reqs]
        )
        metadata = self._cross_attn_metadata(step, encoder_reqs)
        if runner.encoder_states is not None:
            # Absorbed cross-attention: E itself is the cache, written once for all layers.
            write_encoder_states(
                encoder_hidden_states,
                runner.encoder_states.values,
                runner.encoder_states.scales,
                metadata[ENCODER_STATES_LAYER].common.slot_mapping,
            )
            return
        placeholder = torch.zeros(len(encoder_reqs), dtype=torch.long, device=runner.device)
        with set_forward_context(ForwardContext(metadata, cross_kv_only=True)):
            runner.model(placeholder, placeholder, encoder_hidden_states=encoder_hidden_states)

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decoder step whose cross K/V are all in the cache already (what CUDA graphs run)."""
        return self.runner.model(input_ids, positions, encoder_hidden_states=None)

    # ---- encoder ----
    def _run_encoders(self, hashes_to_run: dict[str, str]) -> int:
        if not hashes_to_run:
            return 0
        requests = self.runner.input_batch.requests
        inputs = [requests[req_id].encoder_input for req_id in hashes_to_run.values()]
        lengths = np.array([e.num_encoder_tokens for e in inputs], dtype=np.int64)
        metadata = self.runner.uncached_attn_metadata(
            lengths, AttentionType.ENCODER, self.encoder_layers
        )
        with set_forward_context(ForwardContext(metadata)):
            output = self.runner.model.encode(**self._encoder_kwargs(inputs))  # [sum(len), H]
        for content_hash, part in zip(hashes_to_run, output.split(lengths.tolist()), strict=True):
            self.encoder_outputs[content_hash] = part
        self.num_encoder_runs += len(inputs)
        return len(inputs)

    def _encoder_kwargs(self, inputs: list[EncoderInput]) -> dict[str, Any]:
        runner = self.runner
        if inputs[0].audio is not None:
            return {"audio": _audio_to_device([e.audio for e in inputs], runner.device)}
        lengths = np.array([len(e.token_ids) for e in inputs], dtype=np.int64)
        ids = np.concatenate([np.asarray(e.token_ids, dtype=np.int64) for e in inputs])
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = np.arange(len(ids)) - starts
        return {"input_ids": runner._to_device(ids), "positions": runner._to_device(positions)}

    # ---- cross-attention ----
    def _cross_attn_metadata(self, step: StepInputs, encoder_reqs: list[str]) -> dict[str, Any]:
        runner = self.runner
        batch = runner.input_batch
        out: dict[str, Any] = {}
        enc_lens = batch.num_encoder_tokens[step.slots]
        for i, attn_type in enumerate(runner.group_types):
            if attn_type != AttentionType.ENCODER_DECODER:
                continue
            table = batch.block_tables[i]
            slot_mapping = None
            if encoder_reqs:
                w_slots = np.array([batch.requests[r].slot for r in encoder_reqs], dtype=np.int64)
                w_lens = batch.num_encoder_tokens[w_slots]
                positions = np.arange(int(w_lens.sum())) - np.repeat(
                    np.cumsum(w_lens) - w_lens, w_lens
                )
                slot_mapping = table.slot_mapping(np.repeat(w_slots, w_lens), positions)
            common = runner.make_common(
                step.query_start_loc,
                enc_lens,
                causal=False,
                block_table=table.rows(step.slots, runner.device),
                slot_mapping=slot_mapping,
                query_positions=step.positions,
            )
            out.update(dict.fromkeys(runner.group_layers[i], runner.builders[i].build(common)))
        return out


def _audio_to_device(clips: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The step's 1-D float32 clips on `device`, moved in ONE copy: packed into one host buffer
    (pinned on CUDA), sent with one non-blocking transfer, split on the device (views).

    The caching host allocator keeps the pinned buffer from reuse until the copy is done.
    """
    lengths = [c.shape[0] for c in clips]
    host = torch.empty(sum(lengths), dtype=torch.float32, pin_memory=device.type == "cuda")
    np.concatenate(clips, out=host.numpy())  # the one host copy; casts other float dtypes
    return list(host.to(device, non_blocking=True).split(lengths))
