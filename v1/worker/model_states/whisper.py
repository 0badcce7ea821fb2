"""Whisper at the runner level: the encoder-decoder strategy plus each request's no-speech
probability (softmax of the raw logits at its <|startoftranscript|> position, probability of
<|nospeech|>, as transformers and openai-whisper compute it), reported once per request in
`ModelRunnerOutput.extras[req_id]["no_speech_prob"]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from v1.core.sched_output import ModelRunnerOutput, NewRequestData
from v1.forward_context import ForwardContext, set_forward_context
from v1.worker.input_batch import CachedRequestState
from v1.worker.model_states.encoder_decoder import EncoderDecoderState
from v1.worker.sampled_output import PendingSampledStep

if TYPE_CHECKING:
    from v1.worker.model_runner import StepInputs

NO_SPEECH_PROB = "no_speech_prob"


class WhisperState(EncoderDecoderState):
    def on_model_loaded(self) -> None:
        super().on_model_loaded()
        model = self.runner.model
        self.sot_token_id: int = model.decoder_start_token_id
        self.no_speech_token_id: int = model.no_speech_token_id
        self.sot_positions = np.full(self.runner.max_num_reqs, -1, dtype=np.int64)
        """Per slot: index of <|startoftranscript|> in the request's prompt (-1: none)."""
        self.pending_no_speech: dict[str, float] = {}
        """Computed on a prompt chunk that did not sample yet: reported with the first token."""

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        super().on_request_added(state, data)
        prompt = data.prompt_token_ids
        self.sot_positions[state.slot] = (
            prompt.index(self.sot_token_id) if self.sot_token_id in prompt else -1
        )

    def on_request_removed(self, state: CachedRequestState) -> None:
        super().on_request_removed(state)
        self.sot_positions[state.slot] = -1
        self.pending_no_speech.pop(state.req_id, None)

    def sample_async(self, hidden_states: torch.Tensor, step: StepInputs) -> PendingSampledStep:
        rows, row_reqs = self._sot_rows(step)
        no_speech = None
        if rows.size:
            logits = self.runner.model.compute_logits(hidden_states[self.runner._to_device(rows)])
            no_speech = logits.softmax(dim=-1)[:, self.no_speech_token_id].float()  # [k]
        extra = {NO_SPEECH_PROB: no_speech} if no_speech is not None else None
        pending = super().sample_async(hidden_states, step, extra)
        if no_speech is not None:
            sot_req_ids = [step.req_ids[i] for i in row_reqs.tolist()]
            pending.finalize.append(
                lambda output, data: self._record_no_speech(sot_req_ids, data[NO_SPEECH_PROB])
            )
        pending.finalize.append(lambda output, data: self._report_no_speech(output))
        return pending

    def _record_no_speech(self, req_ids: list[str], probs: np.ndarray) -> None:
        requests = self.runner.input_batch.requests
        for req_id, prob in zip(req_ids, probs.tolist(), strict=True):
            if req_id in requests:  # not aborted since the step was launched
                self.pending_no_speech[req_id] = prob

    def _report_no_speech(self, output: ModelRunnerOutput) -> None:
        """Each request's no-speech probability goes out with its first sampled token."""
        if not self.pending_no_speech:
            return
        for req_id, sampled in zip(output.req_ids, output.sampled_token_ids, strict=True):
            if sampled and req_id in self.pending_no_speech:
                prob = self.pending_no_speech.pop(req_id)
                output.extras.setdefault(req_id, {})[NO_SPEECH_PROB] = prob

    def _sot_rows(self, step: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """(packed token rows holding a <|startoftranscript|> this step, their request index)."""
        sot = self.sot_positions[step.slots]  # [R]
        computed = step.seq_lens - step.num_scheduled
        hit = (sot >= computed) & (sot < step.seq_lens)
        row_reqs = np.flatnonzero(hit)
        rows = step.query_start_loc[:-1][row_reqs] + (sot - computed)[row_reqs]
        return rows, row_reqs

    def dummy_run(self, num_tokens: int) -> None:
        """The decoder's max-size step, then the encoder on as many silent windows as one
        step's encoder budget holds (attention skipped, as in every profiling pass)."""
        super().dummy_run(num_tokens)
        runner = self.runner
        num_windows = max(1, runner.config.encoder_budget // runner.model_config.max_encoder_len)
        silence = [torch.zeros(16_000, device=runner.device) for _ in range(num_windows)]
        with set_forward_context(ForwardContext(profiling=True)):
            runner.model.encode(silence)
