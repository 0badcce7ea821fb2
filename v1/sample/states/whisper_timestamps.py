"""Whisper's timestamp rules per slot: which slots use them and their timestamp state (last
timestamp, whether the last two outputs were timestamps, whether sampling starts after a forced
prefix). Steps update the state on the device from the sampled tensor; the host only knows which
rows use the rules and their counts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from v1.host_copy import to_device
from v1.sample.states.slots import SlotRequest, StepRows, push_rows
from v1.sampling_params import SamplingParams

_LAST_TIMESTAMP, _FLAGS = range(2)
"""Columns of the state table (one table: one copy per flush, one gather per step)."""
_LAST_IS_TS, _PENULTIMATE_IS_TS, _AFTER_PREFIX = 1, 2, 4
"""Bits of the _FLAGS column: timestamp state over the outputs so far; _AFTER_PREFIX: no output
yet and the prompt ends with a forced prefix (cleared by the first output)."""
_NEUTRAL = np.array([-1, _PENULTIMATE_IS_TS], dtype=np.int64)
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class WhisperTokenInfo:
    """The special token ids Whisper's timestamp rules need (from the model's generation config)."""

    eos_token_id: int
    """<|endoftext|>; the text tokens are the ids below it."""
    no_timestamps_token_id: int
    """<|notimestamps|>; never generated while timestamps are on."""
    timestamp_begin: int
    """<|0.00|>; every id from here up is a timestamp."""
    max_initial_timestamp_index: int | None = 50
    """The first timestamp is at most timestamp_begin + this (None: no limit)."""

    def ends_with_prefix(self, prompt_token_ids: Sequence[int]) -> bool:
        """The prompt ends with a forced prefix: text or timestamp tokens follow its last
        special token (the `<|startoftranscript|>` sequence, ids after EOS up to
        <|notimestamps|>), as faster-whisper's `sot_sequence [<|0.00|>] prefix`: CTranslate2
        samples from after them. A prompt without special tokens has no prefix."""
        for n, token in enumerate(reversed(prompt_token_ids)):
            if self.eos_token_id < token <= self.no_timestamps_token_id:
                return n > 0
        return False


@dataclass
class WhisperTimestampMetadata:
    """Per-row state of Whisper's timestamp rules, read from the slots' device state."""

    info: WhisperTokenInfo
    rows: torch.Tensor
    """[k] int64 batch rows with whisper_timestamps on."""
    is_first: torch.Tensor
    """[k] bool: no output token yet after a prompt without a prefix (the first token must be
    an early timestamp)."""
    after_prefix: torch.Tensor
    """[k] bool: no output token yet after a prompt that ends with a forced prefix: only
    <|notimestamps|> is banned (CTranslate2's rule, which faster-whisper's `prefix` runs on)."""
    block_timestamps: torch.Tensor
    """[k] bool: the last two outputs were timestamps (or one timestamp only): text must follow."""
    block_text: torch.Tensor
    """[k] bool: a single timestamp ends the outputs: its pair (or EOS) must follow."""
    min_timestamp: torch.Tensor
    """[k] int64: the smallest timestamp id allowed (timestamps never decrease)."""


class WhisperTimestampsState:
    """The timestamp state of the slots; `info` None (not Whisper) keeps the rules off."""

    def __init__(
        self, max_num_reqs: int, device: torch.device, info: WhisperTokenInfo | None
    ) -> None:
        self.info = info
        self.enabled = np.zeros(max_num_reqs, dtype=bool)
        """whisper_timestamps on (host-known)."""
        self._state = np.tile(_NEUTRAL, (max_num_reqs, 1))
        self.state_dev = to_device(np.vstack([self._state, _NEUTRAL]), device)
        """[max_num_reqs + 1, 2] int64 (last timestamp, flags). Its last row (`spare_row`)
        belongs to no request: fixed-shape writes of rows that must not write land there."""
        self.spare_row = max_num_reqs
        self._dirty: set[int] = set()

    @staticmethod
    def needs_general_sampler(params: SamplingParams) -> bool:
        return False  # the fixed-shape sampler has the timestamp rules

    def add(self, slot: int, request: SlotRequest) -> None:
        if request.params.whisper_timestamps and self.info is None:
            raise ValueError("whisper_timestamps needs a Whisper model (no WhisperTokenInfo)")
        self.enabled[slot] = request.params.whisper_timestamps
        self._state[slot] = _NEUTRAL
        if self.info is not None and not request.output_token_ids:
            if self.info.ends_with_prefix(request.prompt_token_ids):
                self._state[slot, _FLAGS] |= _AFTER_PREFIX
        elif request.output_token_ids and self.info is not None:
            # A resumed request's state, as if its outputs had been appended.
            outputs = np.asarray(request.output_token_ids, dtype=np.int64)
            is_timestamp = outputs >= self.info.timestamp_begin
            flags = _LAST_IS_TS if is_timestamp[-1] else 0
            if len(outputs) < 2 or is_timestamp[-2]:
                flags |= _PENULTIMATE_IS_TS
            timestamps = outputs[is_timestamp]
            self._state[slot, _FLAGS] = flags
            self._state[slot, _LAST_TIMESTAMP] = int(timestamps[-1]) if len(timestamps) else -1
        self._dirty.add(slot)

    def remove(self, slot: int) -> None:
        self.enabled[slot] = False
        self._state[slot] = _NEUTRAL
        self._dirty.add(slot)

    def flush(self) -> None:
        if self._dirty:
            push_rows(self.state_dev, self._state, self._dirty)
            self._dirty.clear()

    def stage(self, step: StepRows) -> Callable[[], WhisperTimestampMetadata] | None:
        """Stages the step's host arrays; returns what builds its metadata once they shipped."""
        if self.info is None:
            return None
        rows = np.flatnonzero(self.enabled[step.slots])
        if not len(rows):
            return None
        step.stage("whisper.rows", rows)
        step.stage("whisper.is_first", step.num_output_tokens[rows] == 0)

        def fill() -> WhisperTimestampMetadata:
            dev_rows = step["whisper.rows"]
            return self.rule_metadata(step.idx[dev_rows], dev_rows, step["whisper.is_first"] != 0)

        return fill

    def stage_append(self, step: StepRows) -> np.ndarray:
        """Rows of an append step that use the rules (their arrays staged for `append`)."""
        rows = np.flatnonzero(self.enabled[step.slots]) if self.info is not None else []
        if len(rows):
            step.stage("whisper.rows", rows)
            step.stage("whisper.had_output", step.num_output_tokens[rows] > 0)
        return np.asarray(rows)

    def append(self, step: StepRows, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """The state of the staged rows after appending their `tokens` [n] (device, in order)."""
        if not len(rows):
            return
        idx, dev_rows = step.idx, step["whisper.rows"]
        if len(rows) < len(step.slots):
            idx, tokens = idx[dev_rows], tokens[dev_rows]
        self.state_dev[idx] = self.next_state(
            self.state_dev[idx], tokens, step["whisper.had_output"] != 0
        )

    def rule_metadata(
        self, slots: torch.Tensor, rows: torch.Tensor, is_first: torch.Tensor
    ) -> WhisperTimestampMetadata:
        """The timestamp rules' inputs for `rows` of a step, which belong to `slots` [k]."""
        assert self.info is not None
        state = self.state_dev[slots]
        flags = state[:, _FLAGS]
        last = (flags & _LAST_IS_TS) != 0
        penultimate = (flags & _PENULTIMATE_IS_TS) != 0
        last_timestamp = state[:, _LAST_TIMESTAMP]
        # transformers: after a lone timestamp the same value may repeat (closing the pair),
        # otherwise the next timestamp must be strictly larger.
        min_timestamp = torch.where(last & ~penultimate, last_timestamp, last_timestamp + 1)
        min_timestamp = torch.where(last_timestamp >= 0, min_timestamp, self.info.timestamp_begin)
        after_prefix = is_first & ((flags & _AFTER_PREFIX) != 0)
        return WhisperTimestampMetadata(
            info=self.info,
            rows=rows,
            is_first=is_first & ~after_prefix,
            after_prefix=after_prefix,
            block_timestamps=last & penultimate,
            block_text=last & ~penultimate,
            min_timestamp=min_timestamp,
        )

    def next_state(
        self, state: torch.Tensor, tokens: torch.Tensor, had_output: torch.Tensor
    ) -> torch.Tensor:
        """Rows of `state_dev` [k, 2] after appending `tokens` [k]."""
        assert self.info is not None
        is_timestamp = tokens >= self.info.timestamp_begin
        penultimate = ~had_output | ((state[:, _FLAGS] & _LAST_IS_TS) != 0)
        state = state.clone()
        state[:, _FLAGS] = (
            is_timestamp.long() * _LAST_IS_TS + penultimate.long() * _PENULTIMATE_IS_TS
        )
        state[:, _LAST_TIMESTAMP] = torch.where(is_timestamp, tokens, state[:, _LAST_TIMESTAMP])
        return state


def apply_whisper_timestamp_rules(logits: torch.Tensor, whisper: WhisperTimestampMetadata) -> None:
    """transformers' WhisperTimeStampLogitsProcessor on the rows with timestamps on.

    <|notimestamps|> is never generated; timestamps come in pairs (after a lone timestamp only a
    timestamp or a special token >= EOS, after a pair only non-timestamps) and never decrease;
    the first output is a timestamp <= timestamp_begin + max_initial_timestamp_index; when the
    timestamps' total probability beats every text token, a timestamp is forced. The first
    output after a forced prefix (the prompt ends with text or a timestamp) is free but for
    <|notimestamps|>: CTranslate2 (faster-whisper's `prefix`) applies no other rule there.
    """
    scores = logits[whisper.rows]  # [k, vocab]
    whisper_timestamp_rules_(scores, whisper)
    logits[whisper.rows] = scores


def whisper_timestamp_rules_(
    scores: torch.Tensor, whisper: WhisperTimestampMetadata, active: torch.Tensor | None = None
) -> None:
    """The timestamp rules in place on `scores` [k, vocab], whose rows are `whisper`'s rows;
    `active` [k] bool (None: all) leaves the other rows untouched (the fixed-shape sampler
    applies the rules to every row of a step and enables them per row)."""
    info = whisper.info
    tb = info.timestamp_begin
    vocab_ids = torch.arange(scores.shape[1], device=scores.device)
    is_timestamp = vocab_ids >= tb  # [vocab]
    mask = vocab_ids == info.no_timestamps_token_id
    mask = mask | (whisper.block_timestamps.unsqueeze(1) & is_timestamp)
    mask = mask | (whisper.block_text.unsqueeze(1) & (vocab_ids < info.eos_token_id))
    mask = mask | (is_timestamp & (vocab_ids < whisper.min_timestamp.unsqueeze(1)))
    first_banned = ~is_timestamp
    if info.max_initial_timestamp_index is not None:
        first_banned = first_banned | (vocab_ids > tb + info.max_initial_timestamp_index)
    mask = mask | (whisper.is_first.unsqueeze(1) & first_banned)
    if active is not None:
        mask = mask & active.unsqueeze(1)
    scores.masked_fill_(mask, _NEG_INF)

    logprobs = torch.log_softmax(scores, dim=-1)
    timestamp_logprob = logprobs[:, tb:].logsumexp(dim=-1)
    max_text_logprob = logprobs[:, :tb].max(dim=-1).values
    force_timestamp = (timestamp_logprob > max_text_logprob) & ~whisper.after_prefix
    if active is not None:
        force_timestamp = force_timestamp & active
    scores[:, :tb].masked_fill_(force_timestamp.unsqueeze(1), _NEG_INF)
