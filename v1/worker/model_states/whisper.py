"""Whisper at the runner level: the encoder-decoder strategy plus each request's no-speech
probability and, for word_timestamps requests, the times of their text tokens (`WhisperState`).
Must hold: each is reported once per request, in `ModelRunnerOutput.extras[req_id]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from v1.attention.backend import AttentionType
from v1.core.sched_output import ModelRunnerOutput, NewRequestData
from v1.forward_context import ForwardContext, set_forward_context
from v1.logger import init_logger
from v1.models.interfaces import SupportsWhisper
from v1.sample.states.whisper_timestamps import WhisperTokenInfo
from v1.worker.input_batch import CachedRequestState
from v1.worker.model_states.base import StateContext
from v1.worker.model_states.encoder_decoder import EncoderDecoderState
from v1.worker.sampled_output import PendingSampledStep
from v1.worker.whisper_alignment import alignment_matrix, boundaries
from v1.worker.whisper_encoder_graphs import WhisperEncoderGraphs, make_whisper_encoder_graphs

if TYPE_CHECKING:
    from v1.core.protocol import EncoderInput
    from v1.sampling_params import SamplingParams
    from v1.worker.kv_cache_views import LayerCache
    from v1.worker.step_inputs import StepInputs

logger = init_logger(__name__)

NO_SPEECH_PROB = "no_speech_prob"
TOKEN_TIMES = "token_times"
SAMPLES_PER_FRAME = 160
"""Log-mel hop at 16 kHz."""


@dataclass
class _WordTimingRequest:
    """What the alignment pass of one word_timestamps request needs."""

    params: SamplingParams
    eos_token_id: int | None
    num_prompt_tokens: int
    num_frames: int
    """10 ms mel frames of audio in the window."""
    encoder_output: torch.Tensor | None = None
    """The window's encoder output [S, d], kept from the request's first step."""
    timed: bool = False
    """Its alignment pass ran (a launched step after the last one does not run it again)."""


class WhisperState(EncoderDecoderState):
    """The no-speech probability is the softmax of the raw logits at a request's
    <|startoftranscript|> position, probability of <|nospeech|> (as transformers and
    openai-whisper compute it), in `extras[req_id]["no_speech_prob"]`. Token times come from
    an eager alignment pass over the window's kept encoder output (v1/worker/whisper_alignment),
    in `extras[req_id]["token_times"]` with the output that ends them."""

    model_interfaces = (SupportsWhisper,)

    def __init__(self, ctx: StateContext) -> None:
        super().__init__(ctx)
        tokens = self.info.whisper_tokens
        assert tokens is not None
        self.tokens = tokens
        self.sot_token_id: int = tokens.sot
        self.no_speech_token_id: int = tokens.no_speech
        self.sot_positions = np.full(self.max_num_reqs, -1, dtype=np.int64)
        """Per slot: index of <|startoftranscript|> in the request's prompt (-1: none)."""
        self.pending_no_speech: dict[str, float] = {}
        """Computed on a prompt chunk that did not sample yet: reported with the first token."""
        self.word_timing: dict[str, _WordTimingRequest] = {}
        """word_timestamps requests in the batch."""
        self.word_timing_slots = np.zeros(self.max_num_reqs, dtype=bool)
        self.encoder_graphs: WhisperEncoderGraphs | None = None
        """Small models on CUDA: the encoder (log-mel included) in CUDA graphs."""

    def on_kv_cache_ready(self, kv_caches: dict[str, LayerCache]) -> None:
        super().on_kv_cache_ready(kv_caches)
        if self.device.type != "cuda":
            return
        self.encoder_graphs = make_whisper_encoder_graphs(
            self.model, self.attn_metadata, self.encoder_layers, self.config, self.device
        )
        if self.encoder_graphs is None:
            self._warm_encoder()  # the graphs' capture warmed every size they take

    def _encode(self, inputs: list[EncoderInput], lengths: np.ndarray) -> torch.Tensor:
        if self.encoder_graphs is None or inputs[0].audio is None:
            return super()._encode(inputs, lengths)
        return self.encoder_graphs.encode(self._encoder_kwargs(inputs)["audio"])

    @torch.inference_mode()
    def _warm_encoder(self) -> None:
        """Encodes silent windows once in each power-of-two batch up to a step's encoder
        budget. cuDNN runs the encoder's attention in such parts (`power_of_two_parts`), and a
        part's first run builds a plan (~67 ms on an H200); every size loads the GEMM kernels
        its row count picks (one load took 170 ms), and FlashAttention-4, where it takes 8+
        windows, compiles on its first call: without this, the first steps of each new size
        stalled (0.65 s in a timed 256-clip run)."""
        start = time.perf_counter()
        max_windows = self.config.encoder_budget_inputs
        length = self.model_config.max_encoder_len
        n = 1
        while n <= max_windows:
            lengths = np.full(n, length, dtype=np.int64)
            metadata = self.attn_metadata.uncached(
                lengths, AttentionType.ENCODER, self.encoder_layers
            )
            silence = [torch.zeros(16_000, device=self.device) for _ in range(n)]
            with set_forward_context(ForwardContext(metadata)):
                self.model.encode(silence)
            n *= 2
        torch.cuda.synchronize(self.device)
        logger.info(
            "warmed the encoder for 1-%d windows a step in %.2f s",
            n // 2,
            time.perf_counter() - start,
        )

    def whisper_token_info(self) -> WhisperTokenInfo:
        tokens = self.tokens
        return WhisperTokenInfo(
            eos_token_id=tokens.eos,
            no_timestamps_token_id=tokens.no_timestamps,
            timestamp_begin=tokens.timestamp_begin,
            max_initial_timestamp_index=tokens.max_initial_timestamp_index,
        )

    def common_sampler_signatures(self) -> tuple[list[int | None], list[bool]]:
        """Transcription windows ask for logprobs=0 (the fallback rule's average logprob)."""
        return [0, None], [False]

    def eos_token_id(self, data: NewRequestData) -> int | None:
        return data.eos_token_id if data.eos_token_id is not None else self.tokens.eos

    def on_request_added(self, state: CachedRequestState, data: NewRequestData) -> None:
        super().on_request_added(state, data)
        prompt = data.prompt_token_ids
        self.sot_positions[state.slot] = (
            prompt.index(self.sot_token_id) if self.sot_token_id in prompt else -1
        )
        params = data.sampling_params
        if params is not None and params.word_timestamps and data.encoder_input is not None:
            audio = data.encoder_input.audio
            num_frames = (
                audio.shape[0] // SAMPLES_PER_FRAME
                if audio is not None
                else 2 * data.encoder_input.num_encoder_tokens
            )
            self.word_timing[state.req_id] = _WordTimingRequest(
                params, self.eos_token_id(data), len(prompt), num_frames
            )
            self.word_timing_slots[state.slot] = True

    def on_request_removed(self, state: CachedRequestState) -> None:
        super().on_request_removed(state)
        self.sot_positions[state.slot] = -1
        self.pending_no_speech.pop(state.req_id, None)
        self.word_timing.pop(state.req_id, None)
        self.word_timing_slots[state.slot] = False

    def _write_cross_kv(self, step: StepInputs, encoder_reqs: list[str]) -> None:
        """Also keeps the encoder output of word_timestamps requests for their alignment pass
        (the encoder cache may drop it before they end)."""
        requests = self.input_batch.requests
        for req_id in encoder_reqs:
            timing = self.word_timing.get(req_id)
            if timing is not None:
                content_hash = requests[req_id].encoder_input.content_hash
                timing.encoder_output = self.encoder_outputs[content_hash]
        super()._write_cross_kv(step, encoder_reqs)

    def sample_async(self, hidden_states: torch.Tensor, step: StepInputs) -> PendingSampledStep:
        rows, row_reqs = self._sot_rows(step)
        no_speech = None
        if rows.size:
            logits = self.model.compute_logits(hidden_states[self.to_device(rows)])
            no_speech = logits.float().softmax(dim=-1)[:, self.no_speech_token_id]  # [k]
        extra = {NO_SPEECH_PROB: no_speech} if no_speech is not None else None
        pending = super().sample_async(hidden_states, step, extra)
        if no_speech is not None:
            sot_req_ids = [step.req_ids[i] for i in row_reqs.tolist()]
            pending.finalize.append(
                lambda output, data: self._record_no_speech(sot_req_ids, data[NO_SPEECH_PROB])
            )
        pending.finalize.append(lambda output, data: self._report_no_speech(output))
        timed = np.flatnonzero(self.word_timing_slots[pending.slots])
        if timed.size:
            rows = pending.keep_rows[timed]
            slots, positions = pending.slots[timed], pending.positions[timed]
            generations = pending.generations[timed]
            pending.finalize.append(
                lambda output, data: self._time_finished_words(
                    output, rows, slots, positions, generations
                )
            )
        return pending

    def _record_no_speech(self, req_ids: list[str], probs: np.ndarray) -> None:
        requests = self.input_batch.requests
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

    # ---- word timestamps ----
    def _time_finished_words(
        self,
        output: ModelRunnerOutput,
        rows: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
        generations: np.ndarray,
    ) -> None:
        """Runs the alignment pass of each word_timestamps request whose token sampled in
        this step ends it, and reports its token times with that (final) output."""
        batch = self.input_batch
        held = batch.slot_generations[slots] == generations
        matrices: dict[str, torch.Tensor | None] = {}
        for row, slot, position in zip(rows[held], slots[held], positions[held], strict=True):
            req_id = output.req_ids[row]
            timing = self.word_timing.get(req_id)
            token_ids = batch.token_ids[slot, : position + 1]  # prompt + outputs, resolved
            if timing is None or timing.timed or not self._ends_request(timing, token_ids):
                continue
            timing.timed = True
            try:
                matrices[req_id] = self._alignment_matrix(timing, token_ids)
            except (RuntimeError, ValueError) as e:
                # The request ends without times (the frontend reports it): the step goes on.
                logger.warning("word timestamps of %s failed: %s", req_id, e)
            timing.encoder_output = None
        for req_id, matrix in matrices.items():
            # sync: the first matrix reaches the host (every pass was launched before it).
            times = boundaries(matrix.cpu().numpy()) if matrix is not None else []
            output.extras.setdefault(req_id, {})[TOKEN_TIMES] = times

    def _ends_request(self, timing: _WordTimingRequest, token_ids: np.ndarray) -> bool:
        """The scheduler's stop rules (EOS, stop ids, max_tokens, max_model_len) on the last
        sampled token."""
        params = timing.params
        num_output = len(token_ids) - timing.num_prompt_tokens
        room = self.max_model_len - timing.num_prompt_tokens
        max_tokens = min(params.max_tokens or room, room)
        if num_output >= max_tokens or len(token_ids) >= self.max_model_len:
            return True
        if num_output < params.min_tokens:
            return False
        token = int(token_ids[-1])
        if token == timing.eos_token_id and not params.ignore_eos:
            return True
        return token in (params.stop_token_ids or ())

    def _alignment_matrix(
        self, timing: _WordTimingRequest, token_ids: np.ndarray
    ) -> torch.Tensor | None:
        """openai-whisper's alignment input: the prompt from <|startoftranscript|> (previous
        text dropped) with <|notimestamps|>, the generated text tokens (timestamps dropped),
        <|endoftext|>; its alignment heads' cross-attention -> the DTW matrix on the device
        (None: no text token to time)."""
        if timing.encoder_output is None:
            raise RuntimeError("the window's encoder output was not kept")
        tokens = self.tokens
        prompt = token_ids[: timing.num_prompt_tokens].tolist()
        prompt = prompt[prompt.index(self.sot_token_id) :] if self.sot_token_id in prompt else []
        # Text forced in the prompt after the <|startoftranscript|> sequence (a prefix, or the
        # kept tokens of a beam or best-of sample given back for timing) is timed as well.
        forced = [t for t in prompt[1:] if t < tokens.eos]
        prompt = prompt[:1] + [
            t
            for t in prompt[1:]
            if tokens.eos < t < tokens.timestamp_begin and t != tokens.no_timestamps
        ]
        prompt.append(tokens.no_timestamps)
        outputs = token_ids[timing.num_prompt_tokens :]
        text = forced + outputs[outputs < tokens.eos].tolist()
        if not text:
            return None
        ids = self.to_device(np.array([*prompt, *text, tokens.eos]))
        weights = self.model.alignment_attention(
            ids, timing.encoder_output, self.info.alignment_heads
        )
        return alignment_matrix(weights, timing.num_frames, first_row=len(prompt) - 1)

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
        silence = [
            torch.zeros(16_000, device=self.device)
            for _ in range(self.config.encoder_budget_inputs)
        ]
        with set_forward_context(ForwardContext(profiling=True)):
            self.model.encode(silence)
