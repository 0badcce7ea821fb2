"""Persistent per-slot sampling state of the model runner's batch, and its per-step metadata.

Slots are the rows 0..max_num_reqs-1 of the runner's persistent batch. Parameters, token histories
and rule state live in host tensors updated on add/remove/append; `make_metadata` gathers the
step's rows with vectorized indexing and ships them to the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from v1.sample.metadata import (
    RowTokenIds,
    SamplingMetadata,
    WhisperTimestampMetadata,
    WhisperTokenInfo,
)
from v1.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): the seed of a seeded request's draw at output index `step`.

    Reseeding per step makes a request's noise a function of its seed and step only: the same
    whatever the batch, and the same again after preemption and resume.
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class _TokenIdTable:
    """A token id list per slot in one host tensor [num_slots, width], padded with -1.

    The width grows to the longest list seen, so short lists (the usual case) stay cheap.
    """

    def __init__(self, num_slots: int) -> None:
        self.ids = torch.full((num_slots, 0), -1, dtype=torch.int32)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64)

    def set(self, slot: int, token_ids: Sequence[int]) -> None:
        num_ids = len(token_ids)
        if num_ids > self.ids.shape[1]:
            grown = torch.full((self.ids.shape[0], num_ids), -1, dtype=torch.int32)
            grown[:, : self.ids.shape[1]] = self.ids
            self.ids = grown
        self.ids[slot] = -1
        self.ids[slot, :num_ids] = torch.tensor(token_ids, dtype=torch.int32)
        self.lengths[slot] = num_ids

    def clear(self, slot: int) -> None:
        self.ids[slot] = -1
        self.lengths[slot] = 0

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[k, width of the longest of these lists] int64."""
        width = int(self.lengths[slots].max()) if len(slots) else 0
        return self.ids[slots, :width].long()


class SamplingState:
    """Sampling parameters, token histories and generators of the requests in the runner's slots."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        whisper: WhisperTokenInfo | None = None,
        seed: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.whisper = whisper
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

        def zeros(dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
            return torch.full((max_num_reqs,), fill, dtype=dtype)

        self.active = zeros(torch.bool)
        self.temperature = zeros(torch.float32, 1.0)
        self.top_p = zeros(torch.float32, 1.0)
        self.top_k = zeros(torch.int64)
        self.min_p = zeros(torch.float32)
        self.repetition_penalty = zeros(torch.float32, 1.0)
        self.frequency_penalty = zeros(torch.float32)
        self.presence_penalty = zeros(torch.float32)
        self.min_tokens = zeros(torch.int64)
        self.max_output_tokens = zeros(torch.int64, -1)
        """-1: no limit known here (no forced EOS)."""
        self.forced_eos_token_id = zeros(torch.int64, -1)
        self.no_repeat_ngram_size = zeros(torch.int64)
        self.num_logprobs = zeros(torch.int64, -1)
        """-1: no logprobs."""
        self.whisper_timestamps = zeros(torch.bool)
        self.has_seed = zeros(torch.bool)
        self.seeds: dict[int, int] = {}
        self.generators: dict[int, torch.Generator] = {}

        # Decoder sequence (prompt, then outputs) per slot: penalties and no-repeat-ngram.
        self.token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.num_prompt_tokens = zeros(torch.int64)
        self.num_output_tokens = zeros(torch.int64)

        self.allowed_token_ids = _TokenIdTable(max_num_reqs)
        self.suppress_token_ids = _TokenIdTable(max_num_reqs)
        self.begin_suppress_token_ids = _TokenIdTable(max_num_reqs)
        self.min_tokens_stop_ids = _TokenIdTable(max_num_reqs)
        self.forced_positions = _TokenIdTable(max_num_reqs)
        self.forced_tokens = _TokenIdTable(max_num_reqs)

        # Whisper timestamp state over the outputs (transformers' view of `seq[begin_index:]`).
        self.last_is_timestamp = zeros(torch.bool)
        self.penultimate_is_timestamp = zeros(torch.bool, True)
        """True while there are fewer than two outputs, as in transformers."""
        self.last_timestamp = zeros(torch.int64, -1)
        """The latest timestamp id among the outputs, -1 for none."""

    # ---- lifecycle ----
    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_id: int | None,
        *,
        max_output_tokens: int | None = None,
    ) -> None:
        """Takes over `slot` for a new or resumed request (resumed: with its earlier outputs).

        The output limit for forced_eos_token_id is `max_output_tokens` when given, else
        params.max_tokens, capped by what max_model_len leaves after the prompt.
        """
        assert not self.active[slot], f"slot {slot} is taken"
        num_prompt, num_output = len(prompt_token_ids), len(output_token_ids)
        if num_prompt + num_output > self.max_model_len:
            raise ValueError(
                f"{num_prompt + num_output} tokens do not fit max_model_len={self.max_model_len}"
            )
        if params.whisper_timestamps and self.whisper is None:
            raise ValueError("whisper_timestamps needs a Whisper model (no WhisperTokenInfo)")
        self.active[slot] = True
        self.temperature[slot] = params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = max(params.top_k, 0)
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.min_tokens[slot] = params.min_tokens
        limit = max_output_tokens if max_output_tokens is not None else params.max_tokens
        room = self.max_model_len - num_prompt
        self.max_output_tokens[slot] = room if limit is None else min(limit, room)
        self.forced_eos_token_id[slot] = _or_minus_one(params.forced_eos_token_id)
        self.no_repeat_ngram_size[slot] = params.no_repeat_ngram_size or 0
        self.num_logprobs[slot] = _or_minus_one(params.logprobs)
        self.whisper_timestamps[slot] = params.whisper_timestamps
        self.has_seed[slot] = params.seed is not None
        if params.seed is not None:
            self.seeds[slot] = params.seed
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed & _MASK64)
            self.generators[slot] = generator

        self.token_ids[slot, :num_prompt] = torch.tensor(prompt_token_ids, dtype=torch.int32)
        self.num_prompt_tokens[slot] = num_prompt
        self.num_output_tokens[slot] = 0

        tables = (
            (self.allowed_token_ids, params.allowed_token_ids),
            (self.suppress_token_ids, params.suppress_tokens),
            (self.begin_suppress_token_ids, params.begin_suppress_tokens),
        )
        for table, token_ids in tables:
            if token_ids:
                table.set(slot, token_ids)
        stop_ids = list(params.all_stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(eos_token_id)
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens_stop_ids.set(slot, stop_ids)
        if params.forced_token_ids:
            self.forced_positions.set(slot, [index for index, _ in params.forced_token_ids])
            self.forced_tokens.set(slot, [token for _, token in params.forced_token_ids])

        if output_token_ids:
            self._restore_outputs(slot, output_token_ids)

    def _restore_outputs(self, slot: int, output_token_ids: list[int]) -> None:
        """A resumed request's earlier outputs: history and Whisper state as if appended."""
        num_prompt, num_output = int(self.num_prompt_tokens[slot]), len(output_token_ids)
        outputs = torch.tensor(output_token_ids, dtype=torch.int64)
        self.token_ids[slot, num_prompt : num_prompt + num_output] = outputs.to(torch.int32)
        self.num_output_tokens[slot] = num_output
        if self.whisper is not None:
            is_timestamp = outputs >= self.whisper.timestamp_begin
            self.last_is_timestamp[slot] = is_timestamp[-1]
            self.penultimate_is_timestamp[slot] = num_output < 2 or bool(is_timestamp[-2])
            timestamps = outputs[is_timestamp]
            self.last_timestamp[slot] = int(timestamps[-1]) if len(timestamps) else -1

    def remove_request(self, slot: int) -> None:
        """Frees `slot`; its parameters go back to neutral values."""
        self.active[slot] = False
        self.temperature[slot] = 1.0
        self.top_p[slot] = 1.0
        self.top_k[slot] = 0
        self.min_p[slot] = 0.0
        self.repetition_penalty[slot] = 1.0
        self.frequency_penalty[slot] = 0.0
        self.presence_penalty[slot] = 0.0
        self.min_tokens[slot] = 0
        self.max_output_tokens[slot] = -1
        self.forced_eos_token_id[slot] = -1
        self.no_repeat_ngram_size[slot] = 0
        self.num_logprobs[slot] = -1
        self.whisper_timestamps[slot] = False
        self.has_seed[slot] = False
        self.seeds.pop(slot, None)
        self.generators.pop(slot, None)
        self.num_prompt_tokens[slot] = 0
        self.num_output_tokens[slot] = 0
        for table in (
            self.allowed_token_ids,
            self.suppress_token_ids,
            self.begin_suppress_token_ids,
            self.min_tokens_stop_ids,
            self.forced_positions,
            self.forced_tokens,
        ):
            table.clear(slot)
        self.last_is_timestamp[slot] = False
        self.penultimate_is_timestamp[slot] = True
        self.last_timestamp[slot] = -1

    def append_output_tokens(
        self, slots: torch.Tensor | list[int], token_ids: torch.Tensor | list[int]
    ) -> None:
        """Records one new output token for each listed slot."""
        slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
        # sync: a device tensor of sampled ids comes to the host here.
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
        assert slots.shape == token_ids.shape and bool(self.active[slots].all())
        positions = self.num_prompt_tokens[slots] + self.num_output_tokens[slots]
        assert bool((positions < self.max_model_len).all()), "token history is full"
        self.token_ids[slots, positions] = token_ids.to(torch.int32)
        if self.whisper is not None:
            is_timestamp = token_ids >= self.whisper.timestamp_begin
            had_output = self.num_output_tokens[slots] > 0
            self.penultimate_is_timestamp[slots] = ~had_output | self.last_is_timestamp[slots]
            self.last_is_timestamp[slots] = is_timestamp
            self.last_timestamp[slots] = torch.where(
                is_timestamp, token_ids, self.last_timestamp[slots]
            )
        self.num_output_tokens[slots] += 1

    # ---- per step ----
    def make_metadata(self, slots: list[int]) -> SamplingMetadata:
        """Metadata for a step whose logits row i belongs to slots[i]."""
        idx = torch.tensor(slots, dtype=torch.int64)
        assert bool(self.active[idx].all()), "make_metadata on a free slot"
        temperature = self.temperature[idx]
        is_greedy = temperature < _GREEDY_EPS
        is_random = ~is_greedy
        top_k, top_p, min_p = self.top_k[idx], self.top_p[idx], self.min_p[idx]
        num_logprobs = self.num_logprobs[idx]
        max_num_logprobs = int(num_logprobs.max()) if len(slots) else -1

        metadata = SamplingMetadata(
            num_reqs=len(slots),
            temperature=self._to_device(temperature),
            all_greedy=bool(is_greedy.all()),
            all_random=bool(is_random.all()),
            top_k=self._to_device(top_k) if bool((is_random & (top_k > 0)).any()) else None,
            top_p=self._to_device(top_p) if bool((is_random & (top_p < 1.0)).any()) else None,
            min_p=self._to_device(min_p) if bool((is_random & (min_p > 0.0)).any()) else None,
            generator=self.generator,
            generators=self._position_generators(idx, is_random),
            max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
        )
        self._add_history_rules(metadata, idx)
        self._add_token_rules(metadata, idx)
        if self.whisper is not None and bool(self.whisper_timestamps[idx].any()):
            metadata.whisper = self._whisper_metadata(idx, self.whisper)
        return metadata

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def _position_generators(
        self, idx: torch.Tensor, is_random: torch.Tensor
    ) -> dict[int, torch.Generator]:
        """Seeds each seeded random row's generator for the output index it samples now."""
        generators = {}
        for row in torch.nonzero(self.has_seed[idx] & is_random).flatten().tolist():
            slot = int(idx[row])
            generator = self.generators[slot]
            generator.manual_seed(step_seed(self.seeds[slot], int(self.num_output_tokens[slot])))
            generators[row] = generator
        return generators

    def _add_history_rules(self, metadata: SamplingMetadata, idx: torch.Tensor) -> None:
        """Penalties and no-repeat-ngram: the rules that read the token history."""
        repetition = self.repetition_penalty[idx]
        frequency = self.frequency_penalty[idx]
        presence = self.presence_penalty[idx]
        ngram_size = self.no_repeat_ngram_size[idx]
        uses_penalties = (repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)
        uses_ngram = ngram_size > 0
        needs_history = uses_penalties | uses_ngram
        if not bool(needs_history.any()):
            return
        num_prompt, num_output = self.num_prompt_tokens[idx], self.num_output_tokens[idx]
        # Rows that read no history may be cut short: only rows in needs_history use it.
        width = int((num_prompt + num_output)[needs_history].max())
        metadata.token_ids = self._to_device(self.token_ids[idx, :width].long())
        metadata.num_prompt_tokens = self._to_device(num_prompt)
        metadata.num_output_tokens = self._to_device(num_output)
        if bool(uses_penalties.any()):
            metadata.no_penalties = False
            metadata.repetition_penalties = self._to_device(repetition)
            metadata.frequency_penalties = self._to_device(frequency)
            metadata.presence_penalties = self._to_device(presence)
        if bool(uses_ngram.any()):
            metadata.no_repeat_ngram_size = self._to_device(ngram_size)
            metadata.max_no_repeat_ngram_size = int(ngram_size.max())

    def _add_token_rules(self, metadata: SamplingMetadata, idx: torch.Tensor) -> None:
        """Allowed/suppressed/min_tokens id lists and forced tokens for this step's rows."""
        num_output = self.num_output_tokens[idx]
        metadata.allowed_token_ids = self._row_token_ids(
            self.allowed_token_ids, idx, torch.ones_like(num_output, dtype=torch.bool)
        )
        metadata.suppress_token_ids = self._row_token_ids(
            self.suppress_token_ids, idx, torch.ones_like(num_output, dtype=torch.bool)
        )
        metadata.begin_suppress_token_ids = self._row_token_ids(
            self.begin_suppress_token_ids, idx, num_output == 0
        )
        metadata.min_tokens_stop_ids = self._row_token_ids(
            self.min_tokens_stop_ids, idx, num_output < self.min_tokens[idx]
        )

        forced = torch.full_like(num_output, -1)
        if bool((self.forced_positions.lengths[idx] > 0).any()):
            positions = self.forced_positions.gather(idx)  # [n, width]
            matches = positions == num_output.unsqueeze(1)
            first_match = matches.int().argmax(dim=1, keepdim=True)
            tokens = self.forced_tokens.gather(idx).gather(1, first_match).squeeze(1)
            forced = torch.where(matches.any(dim=1), tokens, forced)
        forced_eos = self.forced_eos_token_id[idx]
        max_output = self.max_output_tokens[idx]
        is_last = (forced_eos >= 0) & (max_output > 0) & (num_output == max_output - 1)
        forced = torch.where(is_last, forced_eos, forced)
        if bool((forced >= 0).any()):
            metadata.forced_token_ids = self._to_device(forced)

    def _row_token_ids(
        self, table: _TokenIdTable, idx: torch.Tensor, active: torch.Tensor
    ) -> RowTokenIds | None:
        rows = torch.nonzero(active & (table.lengths[idx] > 0)).flatten()
        if len(rows) == 0:
            return None
        token_ids = table.gather(idx[rows])
        return RowTokenIds(rows=self._to_device(rows), token_ids=self._to_device(token_ids))

    def _whisper_metadata(
        self, idx: torch.Tensor, info: WhisperTokenInfo
    ) -> WhisperTimestampMetadata:
        rows = torch.nonzero(self.whisper_timestamps[idx]).flatten()
        slots = idx[rows]
        last = self.last_is_timestamp[slots]
        penultimate = self.penultimate_is_timestamp[slots]
        last_timestamp = self.last_timestamp[slots]
        # transformers: after a lone timestamp the same value may repeat (closing the pair),
        # otherwise the next timestamp must be strictly larger.
        min_timestamp = torch.where(last & ~penultimate, last_timestamp, last_timestamp + 1)
        min_timestamp = torch.where(last_timestamp >= 0, min_timestamp, info.timestamp_begin)
        return WhisperTimestampMetadata(
            info=info,
            rows=self._to_device(rows),
            is_first=self._to_device(self.num_output_tokens[slots] == 0),
            block_timestamps=self._to_device(last & penultimate),
            block_text=self._to_device(last & ~penultimate),
            min_timestamp=self._to_device(min_timestamp),
        )


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
