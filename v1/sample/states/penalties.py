"""Per-slot repetition/frequency/presence penalties and no-repeat-ngram, with the token history
they read. The history (prompt, then outputs) is written on the device from the sampled tensor,
so a step can be built before the previous one's tokens reach the host (pipelined steps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from v1.host_copy import parts_to_device, to_device
from v1.sample.states.slots import SlotRequest, StepRows, push_rows
from v1.sampling_params import SamplingParams

_REPETITION, _FREQUENCY, _PRESENCE = range(3)
_NEUTRAL = np.array([1.0, 0.0, 0.0], dtype=np.float32)
_NEG_INF = float("-inf")


@dataclass
class PenaltiesMetadata:
    """A step's penalties and n-gram bans; rows follow the logits' rows."""

    token_ids: torch.Tensor
    """[n, L] int64 decoder sequence (prompt then outputs). Only the first num_prompt_tokens +
    num_output_tokens entries of a row are valid (rows without a rule may be cut short)."""
    num_prompt_tokens: torch.Tensor
    """[n] int64."""
    num_output_tokens: torch.Tensor
    """[n] int64."""
    repetition_penalties: torch.Tensor | None = None
    """[n] float32 (1.0 = off); None (with the two below) when no row has a penalty."""
    frequency_penalties: torch.Tensor | None = None
    """[n] float32 (0.0 = off)."""
    presence_penalties: torch.Tensor | None = None
    """[n] float32 (0.0 = off)."""
    no_repeat_ngram_size: torch.Tensor | None = None
    """[n] int64 (0 = off); None when no row uses it."""
    max_no_repeat_ngram_size: int = 0

    def apply(self, logits: torch.Tensor) -> None:
        """The penalties (they move values), then the n-gram bans, in place."""
        if self.repetition_penalties is not None:
            apply_penalties(logits, self)
        if self.no_repeat_ngram_size is not None:
            apply_no_repeat_ngram(logits, self)


class PenaltiesState:
    """Penalties, no-repeat-ngram sizes and the decoder token history of the slots."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.device = device
        self._penalties = np.tile(_NEUTRAL, (max_num_reqs, 1))
        self._penalties_dev = to_device(self._penalties, device)
        self.no_repeat_ngram_size = np.zeros(max_num_reqs, dtype=np.int64)
        """0: off."""
        self.no_repeat_ngram_size_dev = to_device(self.no_repeat_ngram_size, device)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens_dev = to_device(self.num_prompt_tokens, device)
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len), dtype=torch.int32, device=device
        )
        """Decoder sequence (prompt, then outputs) per slot."""
        self._dirty: set[int] = set()
        self._new_histories: dict[int, np.ndarray] = {}
        """Slot -> the sequence of a request added since the last flush: a step's new requests
        go to `token_ids` in one copy and one scatter (written a request at a time, the copy
        alone took 26-34 us of host a request on an H200 host: 6.6-8.7 ms of a 256-clip
        whisper-base run, benchmarks/RESULTS.md session 28)."""

    @staticmethod
    def needs_general_sampler(params: SamplingParams) -> bool:
        return (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or bool(params.no_repeat_ngram_size)
        )

    def add(self, slot: int, request: SlotRequest) -> None:
        params = request.params
        self._penalties[slot] = (
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        self.no_repeat_ngram_size[slot] = params.no_repeat_ngram_size or 0
        self.num_prompt_tokens[slot] = len(request.prompt_token_ids)
        sequence = np.asarray(
            request.prompt_token_ids + list(request.output_token_ids), dtype=np.int64
        )
        if len(sequence):
            self._new_histories[slot] = sequence
        else:
            self._new_histories.pop(slot, None)
        self._dirty.add(slot)

    def remove(self, slot: int) -> None:
        self._new_histories.pop(slot, None)
        self._penalties[slot] = _NEUTRAL
        self.no_repeat_ngram_size[slot] = 0
        self.num_prompt_tokens[slot] = 0
        self._dirty.add(slot)

    def flush(self) -> None:
        if self._new_histories:
            self._write_new_histories()
        if self._dirty:
            push_rows(self._penalties_dev, self._penalties, self._dirty)
            push_rows(self.no_repeat_ngram_size_dev, self.no_repeat_ngram_size, self._dirty)
            push_rows(self.num_prompt_tokens_dev, self.num_prompt_tokens, self._dirty)
            self._dirty.clear()

    def _write_new_histories(self) -> None:
        """token_ids[slot, :len] = sequence for every request added since the last flush: the
        values and their (row, column) indices in one pinned copy, then one scatter."""
        slots = np.fromiter(self._new_histories, dtype=np.int64, count=len(self._new_histories))
        sequences = list(self._new_histories.values())
        self._new_histories.clear()
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        num = int(lengths.sum())
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows, cols = np.repeat(slots, lengths), np.arange(num, dtype=np.int64) - starts
        values, rows, cols = parts_to_device([*sequences, rows, cols], self.device, [num] * 3)
        self.token_ids[rows, cols] = values.to(torch.int32)

    def append(self, idx: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """token_ids[idx, positions] = tokens, on the device in stream order."""
        self.token_ids[idx, positions] = tokens.to(torch.int32)

    def stage(self, step: StepRows) -> Callable[[], PenaltiesMetadata] | None:
        """Stages the step's host arrays; returns what builds its metadata once they shipped."""
        slots = step.slots
        penalties = self._penalties[slots]
        use_penalties = (
            (penalties[:, _REPETITION] != 1.0)
            | (penalties[:, _FREQUENCY] != 0.0)
            | (penalties[:, _PRESENCE] != 0.0)
        )
        ngram = self.no_repeat_ngram_size[slots]
        needs_history = use_penalties | (ngram > 0)
        if not bool(needs_history.any()):
            return None
        step.stage("penalties.num_output_tokens", step.num_output_tokens)
        # Rows that read no history may be cut short: only rows in needs_history use it.
        lengths = step.num_prompt_tokens + step.num_output_tokens
        width = int(lengths[needs_history].max())

        def fill() -> PenaltiesMetadata:
            idx = step.idx
            metadata = PenaltiesMetadata(
                token_ids=self.token_ids[idx, :width].long(),
                num_prompt_tokens=self.num_prompt_tokens_dev[idx],
                num_output_tokens=step["penalties.num_output_tokens"],
            )
            if bool(use_penalties.any()):
                penalties_dev = self._penalties_dev[idx]
                metadata.repetition_penalties = penalties_dev[:, _REPETITION]
                metadata.frequency_penalties = penalties_dev[:, _FREQUENCY]
                metadata.presence_penalties = penalties_dev[:, _PRESENCE]
            if bool((ngram > 0).any()):
                metadata.no_repeat_ngram_size = self.no_repeat_ngram_size_dev[idx]
                metadata.max_no_repeat_ngram_size = int(ngram.max())
            return metadata

        return fill


def get_token_bin_counts_and_mask(
    token_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token counts [n, vocab] (float32) and presence mask of the `valid` positions."""
    ids = torch.where(valid & (token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]
    return counts, counts > 0


def apply_penalties(logits: torch.Tensor, metadata: PenaltiesMetadata) -> None:
    """vLLM semantics: repetition over prompt + output tokens, frequency/presence over outputs."""
    token_ids = metadata.token_ids
    assert metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    vocab_size = logits.shape[1]
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)  # [L]
    num_prompt = metadata.num_prompt_tokens.unsqueeze(1)
    num_total = num_prompt + metadata.num_output_tokens.unsqueeze(1)
    _, prompt_mask = get_token_bin_counts_and_mask(token_ids, positions < num_prompt, vocab_size)
    output_counts, output_mask = get_token_bin_counts_and_mask(
        token_ids, (positions >= num_prompt) & (positions < num_total), vocab_size
    )
    repetition = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)
    repetition = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * output_mask


def apply_no_repeat_ngram(logits: torch.Tensor, metadata: PenaltiesMetadata) -> None:
    """transformers' NoRepeatNGramLogitsProcessor over each row's decoder sequence.

    With sizes n per row and sequence s of length len: s[t] is banned when t >= n-1 and
    s[t-n+1 : t] equals the last n-1 tokens s[len-n+1 : len]. We grow the match backwards one
    offset at a time (a loop over ngram length, not over requests).
    """
    sizes = metadata.no_repeat_ngram_size
    token_ids = metadata.token_ids
    assert sizes is not None
    lengths = (metadata.num_prompt_tokens + metadata.num_output_tokens).unsqueeze(1)  # [n, 1]
    sizes = sizes.unsqueeze(1)  # [n, 1]
    num_positions = token_ids.shape[1]
    t = torch.arange(num_positions, device=token_ids.device).unsqueeze(0)  # [1, L]
    banned = (sizes > 0) & (t >= sizes - 1) & (t < lengths)  # [n, L]
    for d in range(metadata.max_no_repeat_ngram_size - 1):
        # Compare s[t-1-d] with s[len-1-d], needed only while d < n-1.
        shifted = torch.nn.functional.pad(token_ids, (1 + d, 0), value=-1)[:, :num_positions]
        # Rows without the rule may be longer than the shipped history: clamp keeps them in.
        last = (lengths - 1 - d).clamp(min=0, max=num_positions - 1)
        suffix = token_ids.gather(1, last)  # [n, 1]
        banned &= (shifted == suffix) | (d >= sizes - 1)
    vocab_size = logits.shape[1]
    ids = torch.where(banned & (token_ids < vocab_size), token_ids, vocab_size)
    mask = torch.zeros(logits.shape[0], vocab_size + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, ids, True)
    logits.masked_fill_(mask[:, :vocab_size], _NEG_INF)
