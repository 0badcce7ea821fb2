"""Persistent per-slot sampling state of the model runner's batch, and its per-step metadata.

Slots are the rows 0..max_num_reqs-1 of the runner's persistent batch. Parameters and token-id
lists live in persistent device tensors, written only when a request enters or leaves (dirty rows
are flushed in one batch at the next step). What depends on sampled token VALUES (the token
history for penalties / no-repeat-ngram, Whisper's timestamp state) is updated on the device from
the sampled tensor, so a step can be built before the previous one's tokens reach the host
(pipelined steps). Everything else a step needs (which rules apply to which rows) follows from
token COUNTS, which the host knows, and goes to the device as one packed pinned copy per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from v1.host_copy import to_device
from v1.sample.metadata import (
    RowLogitBias,
    RowTokenIds,
    SamplingMetadata,
    WhisperTimestampMetadata,
    WhisperTokenInfo,
)
from v1.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1

# Columns of the packed per-slot parameter tables.
_F_TEMPERATURE, _F_TOP_P, _F_MIN_P, _F_REPETITION, _F_FREQUENCY, _F_PRESENCE = range(6)
_NUM_F = 6
_I_TOP_K, _I_NGRAM, _I_NUM_PROMPT, _I_LAST_TS, _I_FLAGS = range(5)
_NUM_I = 5
_FLAG_LAST_IS_TS, _FLAG_PENULTIMATE_IS_TS = 1, 2
"""Bits of the _I_FLAGS column: Whisper timestamp state over the outputs so far."""
_NEUTRAL_F = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=np.float32)
_NEUTRAL_I = np.array([0, 0, 0, -1, _FLAG_PENULTIMATE_IS_TS], dtype=np.int64)
_TABLE_COLUMNS = 64
"""Token-id tables grow by this many columns."""
_BAN_TABLE_WIDTH = 128
"""Initial width of the suppress-token table (Whisper's list has ~90 ids)."""


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
    """A token id list per slot: a host copy [num_slots, width] (-1 padded) with its lengths,
    and a device copy refreshed from the host for dirty slots. The width grows to the longest
    list seen, so short lists (the usual case) stay cheap. (With another dtype and fill it
    holds values beside such a list: the logit-bias values.)"""

    def __init__(
        self,
        num_slots: int,
        device: torch.device,
        dtype: type = np.int64,
        fill: float = -1,
        width: int = 0,
    ) -> None:
        self.device = device
        self.fill = fill
        self.ids = np.full((num_slots, width), fill, dtype=dtype)
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self.dev = to_device(self.ids, device)
        self._dirty: set[int] = set()

    def set(self, slot: int, token_ids: Sequence[float]) -> None:
        num_ids = len(token_ids)
        if num_ids > self.ids.shape[1]:
            # Whole columns of 64: the device copy's shape (which sampler graphs are captured
            # for) rarely changes.
            width = -(-num_ids // _TABLE_COLUMNS) * _TABLE_COLUMNS
            grown = np.full((self.ids.shape[0], width), self.fill, dtype=self.ids.dtype)
            grown[:, : self.ids.shape[1]] = self.ids
            self.ids = grown
        self.ids[slot] = self.fill
        self.ids[slot, :num_ids] = token_ids
        self.lengths[slot] = num_ids
        self._dirty.add(slot)

    def clear(self, slot: int) -> None:
        if self.lengths[slot]:
            self.ids[slot] = self.fill
            self.lengths[slot] = 0
            self._dirty.add(slot)

    def flush(self) -> None:
        """Brings the device copy up to date (stream-ordered: earlier steps saw the old rows)."""
        if not self._dirty:
            return
        if self.dev.shape[1] != self.ids.shape[1]:
            self.dev = to_device(self.ids, self.device)
        else:
            _push_rows(self.dev, self.ids, self._dirty)
        self._dirty.clear()

    def rows(self, idx: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """[k, width of the longest of these lists] int64 on the device."""
        width = int(self.lengths[slots].max()) if len(slots) else 0
        return self.dev[idx, :width]


def _push_rows(dev: torch.Tensor, host: np.ndarray, rows: set[int]) -> None:
    """dev[rows] = host[rows]: one pinned copy of the rows, scattered on the device."""
    index = np.fromiter(rows, dtype=np.int64, count=len(rows))
    dev[to_device(index, dev.device)] = to_device(host[index], dev.device)


class _Packer:
    """Collects a step's small host index arrays and ships them in ONE pinned copy."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, array: np.ndarray) -> int:
        self.parts.append(np.asarray(array, dtype=np.int64).reshape(-1))
        return len(self.parts) - 1

    def ship(self, device: torch.device) -> list[torch.Tensor]:
        sizes = [len(p) for p in self.parts]
        flat = to_device(
            np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64), device
        )
        return list(flat.split(sizes))


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

        # Host mirrors: parameters (for the step's flags) and token counts.
        self.active = np.zeros(max_num_reqs, dtype=bool)
        self.fparams = np.tile(_NEUTRAL_F, (max_num_reqs, 1))
        self.iparams = np.tile(_NEUTRAL_I, (max_num_reqs, 1))
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.max_output_tokens = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no limit known here (no forced EOS)."""
        self.forced_eos_token_id = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no logprobs."""
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no prompt logprobs (the runner computes them; the sampler does not)."""
        self.whisper_timestamps = np.zeros(max_num_reqs, dtype=bool)
        self.processed_logprobs = np.zeros(max_num_reqs, dtype=bool)
        """logprobs_mode "processed": logprobs are the rules' output on log_softmax(logits)."""
        self.seeds: dict[int, int] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_output_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Counts are host-known even while the sampled values are still on the device."""

        # Device copies, indexed by slot.
        self.fparams_dev = to_device(self.fparams, self.device)
        self.iparams_dev = to_device(np.vstack([self.iparams, _NEUTRAL_I]), self.device)
        """Also holds the Whisper timestamp state, which steps update on the device. Its last
        row (slot `max_num_reqs`) belongs to no request: fixed-shape writes of rows that must
        not write land there."""
        self.needs_general_sampler = np.zeros(max_num_reqs, dtype=bool)
        """Per slot: the request uses a rule the fixed-shape sampler (v1/sample/graphed.py)
        does not have (random sampling, penalties, n-gram bans, allowed ids, logit bias,
        processed logprobs): its steps take the general Sampler."""
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len), dtype=torch.int32, device=self.device
        )
        """Decoder sequence (prompt, then outputs) per slot: penalties and no-repeat-ngram."""
        self._dirty: set[int] = set()

        self.allowed_token_ids = _TokenIdTable(max_num_reqs, self.device)
        self.suppress_token_ids = _TokenIdTable(max_num_reqs, self.device, width=_BAN_TABLE_WIDTH)
        self.begin_suppress_token_ids = _TokenIdTable(
            max_num_reqs, self.device, width=_TABLE_COLUMNS
        )
        self.min_tokens_stop_ids = _TokenIdTable(max_num_reqs, self.device, width=_TABLE_COLUMNS)
        self.forced_positions = _TokenIdTable(max_num_reqs, self.device)
        self.forced_tokens = _TokenIdTable(max_num_reqs, self.device)
        self.logit_bias_ids = _TokenIdTable(max_num_reqs, self.device)
        self.logit_bias_values = _TokenIdTable(max_num_reqs, self.device, np.float32, 0.0)
        """A sparse bias per slot: token ids and, in the same columns, their biases."""
        self._tables = (
            self.logit_bias_ids,
            self.logit_bias_values,
            self.allowed_token_ids,
            self.suppress_token_ids,
            self.begin_suppress_token_ids,
            self.min_tokens_stop_ids,
            self.forced_positions,
            self.forced_tokens,
        )

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
        self.fparams[slot] = (
            params.temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        self.iparams[slot] = _NEUTRAL_I
        self.iparams[slot, _I_TOP_K] = max(params.top_k, 0)
        self.iparams[slot, _I_NGRAM] = params.no_repeat_ngram_size or 0
        self.iparams[slot, _I_NUM_PROMPT] = num_prompt
        self.min_tokens[slot] = params.min_tokens
        limit = max_output_tokens if max_output_tokens is not None else params.max_tokens
        room = self.max_model_len - num_prompt
        self.max_output_tokens[slot] = room if limit is None else min(limit, room)
        self.forced_eos_token_id[slot] = _or_minus_one(params.forced_eos_token_id)
        self.num_logprobs[slot] = _or_minus_one(params.logprobs)
        self.num_prompt_logprobs[slot] = _or_minus_one(params.prompt_logprobs)
        self.whisper_timestamps[slot] = params.whisper_timestamps
        self.processed_logprobs[slot] = params.logprobs_mode == "processed"
        self.needs_general_sampler[slot] = (
            params.temperature >= _GREEDY_EPS
            or params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or bool(params.no_repeat_ngram_size)
            or bool(params.allowed_token_ids)
            or bool(params.logit_bias)
            or params.logprobs_mode == "processed"
        )
        if params.seed is not None:
            self.seeds[slot] = params.seed
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed & _MASK64)
            self.generators[slot] = generator
        self.num_prompt_tokens[slot] = num_prompt
        self.num_output_tokens[slot] = num_output
        sequence = np.asarray(prompt_token_ids + list(output_token_ids), dtype=np.int32)
        if len(sequence):
            self.token_ids[slot, : len(sequence)] = to_device(sequence, self.device)

        tables = (
            (self.allowed_token_ids, params.allowed_token_ids),
            (self.suppress_token_ids, params.suppress_tokens),
            (self.begin_suppress_token_ids, params.begin_suppress_tokens),
        )
        for table, token_ids in tables:
            if token_ids:
                table.set(slot, token_ids)
        if params.logit_bias:
            self.logit_bias_ids.set(slot, list(params.logit_bias))
            self.logit_bias_values.set(slot, list(params.logit_bias.values()))
        stop_ids = list(params.all_stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(eos_token_id)
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens_stop_ids.set(slot, stop_ids)
        if params.forced_token_ids:
            self.forced_positions.set(slot, [index for index, _ in params.forced_token_ids])
            self.forced_tokens.set(slot, [token for _, token in params.forced_token_ids])
        if output_token_ids and self.whisper is not None:
            self._restore_whisper_state(slot, output_token_ids, self.whisper)
        self._dirty.add(slot)

    def _restore_whisper_state(
        self, slot: int, output_token_ids: list[int], info: WhisperTokenInfo
    ) -> None:
        """A resumed request's timestamp state, as if its outputs had been appended."""
        outputs = np.asarray(output_token_ids, dtype=np.int64)
        is_timestamp = outputs >= info.timestamp_begin
        flags = _FLAG_LAST_IS_TS if is_timestamp[-1] else 0
        if len(outputs) < 2 or is_timestamp[-2]:
            flags |= _FLAG_PENULTIMATE_IS_TS
        timestamps = outputs[is_timestamp]
        self.iparams[slot, _I_FLAGS] = flags
        self.iparams[slot, _I_LAST_TS] = int(timestamps[-1]) if len(timestamps) else -1

    def remove_request(self, slot: int) -> None:
        """Frees `slot`; its parameters go back to neutral values."""
        self.active[slot] = False
        self.fparams[slot] = _NEUTRAL_F
        self.iparams[slot] = _NEUTRAL_I
        self.min_tokens[slot] = 0
        self.max_output_tokens[slot] = -1
        self.forced_eos_token_id[slot] = -1
        self.num_logprobs[slot] = -1
        self.num_prompt_logprobs[slot] = -1
        self.whisper_timestamps[slot] = False
        self.processed_logprobs[slot] = False
        self.needs_general_sampler[slot] = False
        self.seeds.pop(slot, None)
        self.generators.pop(slot, None)
        self.num_prompt_tokens[slot] = 0
        self.num_output_tokens[slot] = 0
        for table in self._tables:
            table.clear(slot)
        self._dirty.add(slot)

    def flush(self) -> None:
        """Writes the rows of requests that entered or left since the last step to the device
        (one packed copy per table); steps already launched keep reading the old rows."""
        if self._dirty:
            _push_rows(self.iparams_dev, self.iparams, self._dirty)
            _push_rows(self.fparams_dev, self.fparams, self._dirty)
            self._dirty.clear()
        for table in self._tables:
            table.flush()

    # ---- per step ----
    def append_output_tokens(
        self,
        slots: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: torch.Tensor | Sequence[int],
    ) -> None:
        """Records one new output token for each listed slot. `token_ids` may be a device tensor
        not computed yet: the history and Whisper state are updated on the device, in stream
        order; only the counts change on the host."""
        slots = np.asarray(torch.as_tensor(slots).cpu() if torch.is_tensor(slots) else slots)
        slots = slots.astype(np.int64).reshape(-1)
        if not len(slots):
            return
        assert bool(self.active[slots].all())
        positions = self.num_prompt_tokens[slots] + self.num_output_tokens[slots]
        assert bool((positions < self.max_model_len).all()), "token history is full"
        self.flush()
        # Whisper's timestamp state only for the rows that use it (host-known).
        ts_rows = np.flatnonzero(self.whisper_timestamps[slots]) if self.whisper is not None else []
        packer = _Packer()
        packer.add(slots)
        packer.add(positions)
        if len(ts_rows):
            packer.add(ts_rows)
            packer.add(self.num_output_tokens[slots[ts_rows]] > 0)
        shipped = packer.ship(self.device)
        idx, pos = shipped[0], shipped[1]
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device).reshape(-1)
        self.token_ids[idx, pos] = tokens.to(torch.int32)
        if len(ts_rows):
            assert self.whisper is not None
            rows, had_output = shipped[2], shipped[3]
            if len(ts_rows) < len(slots):
                idx, tokens = idx[rows], tokens[rows]
            self.iparams_dev[idx] = next_whisper_state(
                self.iparams_dev[idx], tokens, had_output != 0, self.whisper
            )
        self.num_output_tokens[slots] += 1

    def count_output_tokens(self, slots: np.ndarray) -> None:
        """One new output token for each listed slot whose history and Whisper state the
        fixed-shape sampler already updated on the device (its requests read no history)."""
        assert bool(self.active[slots].all())
        self.num_output_tokens[slots] += 1

    def make_metadata(self, slots: Sequence[int] | np.ndarray) -> SamplingMetadata:
        """Metadata for a step whose logits row i belongs to slots[i]. Reads only host-known
        counts and flags; values sampled by steps still running are read on the device."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        assert bool(self.active[slots].all()), "make_metadata on a free slot"
        self.flush()
        num_output = self.num_output_tokens[slots]
        fparams = self.fparams[slots]
        is_greedy = fparams[:, _F_TEMPERATURE] < _GREEDY_EPS
        is_random = ~is_greedy
        top_k = self.iparams[slots, _I_TOP_K]
        num_logprobs = self.num_logprobs[slots]
        max_num_logprobs = int(num_logprobs.max()) if len(slots) else -1
        penalties = (
            (fparams[:, _F_REPETITION] != 1.0)
            | (fparams[:, _F_FREQUENCY] != 0.0)
            | (fparams[:, _F_PRESENCE] != 0.0)
        )
        ngram = self.iparams[slots, _I_NGRAM] > 0

        # Everything host-known that the device needs this step: one packed copy.
        packer = _Packer()
        i_idx = packer.add(slots)
        i_num_output = packer.add(num_output)
        rules = self._token_rule_rows(slots, num_output)
        i_rules = {name: packer.add(rows) for name, rows in rules.items()}
        forced = self.step_forced_tokens(slots, num_output)
        i_forced = packer.add(forced) if forced is not None else None
        ts_rows = np.flatnonzero(self.whisper_timestamps[slots]) if self.whisper else None
        use_whisper = ts_rows is not None and len(ts_rows) > 0
        if use_whisper:
            i_ts = packer.add(ts_rows)
            i_first = packer.add(num_output[ts_rows] == 0)
        processed_rows = np.flatnonzero(self.processed_logprobs[slots])
        i_processed = packer.add(processed_rows) if len(processed_rows) else None
        shipped = packer.ship(self.device)
        idx = shipped[i_idx]
        fparams_dev = self.fparams_dev[idx]  # [n, NUM_F]

        def column(flag: bool, col: int) -> torch.Tensor | None:
            return fparams_dev[:, col] if flag else None

        metadata = SamplingMetadata(
            num_reqs=len(slots),
            temperature=fparams_dev[:, _F_TEMPERATURE],
            all_greedy=bool(is_greedy.all()),
            all_random=bool(is_random.all()),
            top_k=self.iparams_dev[idx, _I_TOP_K]
            if bool((is_random & (top_k > 0)).any())
            else None,
            top_p=column(bool((is_random & (fparams[:, _F_TOP_P] < 1.0)).any()), _F_TOP_P),
            min_p=column(bool((is_random & (fparams[:, _F_MIN_P] > 0.0)).any()), _F_MIN_P),
            generator=self.generator,
            generators=self._position_generators(slots, is_random),
            max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
        )
        needs_history = penalties | ngram
        if bool(needs_history.any()):
            # Rows that read no history may be cut short: only rows in needs_history use it.
            width = int((self.num_prompt_tokens[slots] + num_output)[needs_history].max())
            metadata.token_ids = self.token_ids[idx, :width].long()
            metadata.num_prompt_tokens = self.iparams_dev[idx, _I_NUM_PROMPT]
            metadata.num_output_tokens = shipped[i_num_output]
            if bool(penalties.any()):
                metadata.no_penalties = False
                metadata.repetition_penalties = fparams_dev[:, _F_REPETITION]
                metadata.frequency_penalties = fparams_dev[:, _F_FREQUENCY]
                metadata.presence_penalties = fparams_dev[:, _F_PRESENCE]
            if bool(ngram.any()):
                metadata.no_repeat_ngram_size = self.iparams_dev[idx, _I_NGRAM]
                metadata.max_no_repeat_ngram_size = int(self.iparams[slots, _I_NGRAM].max())
        for name, table in (
            ("allowed_token_ids", self.allowed_token_ids),
            ("suppress_token_ids", self.suppress_token_ids),
            ("begin_suppress_token_ids", self.begin_suppress_token_ids),
            ("min_tokens_stop_ids", self.min_tokens_stop_ids),
        ):
            if name in i_rules:
                rows = shipped[i_rules[name]]
                token_ids = table.rows(idx[rows], slots[rules[name]])
                setattr(metadata, name, RowTokenIds(rows=rows, token_ids=token_ids))
        if "logit_bias" in i_rules:
            rows = shipped[i_rules["logit_bias"]]
            width = int(self.logit_bias_ids.lengths[slots[rules["logit_bias"]]].max())
            metadata.logit_bias = RowLogitBias(
                rows=rows,
                token_ids=self.logit_bias_ids.dev[idx[rows], :width],
                biases=self.logit_bias_values.dev[idx[rows], :width],
            )
        if i_forced is not None:
            metadata.forced_token_ids = shipped[i_forced]
        if i_processed is not None:
            metadata.processed_logprob_rows = shipped[i_processed]
        if use_whisper:
            assert self.whisper is not None and ts_rows is not None
            rows = shipped[i_ts]
            metadata.whisper = whisper_rule_metadata(
                self.iparams_dev[idx[rows]], rows, shipped[i_first] != 0, self.whisper
            )
        return metadata

    def _token_rule_rows(self, slots: np.ndarray, num_output: np.ndarray) -> dict[str, np.ndarray]:
        """Rows each token-list rule is active on this step (host-known: list lengths, counts)."""
        always = np.ones(len(slots), dtype=bool)
        active = {
            "allowed_token_ids": (self.allowed_token_ids, always),
            "suppress_token_ids": (self.suppress_token_ids, always),
            "begin_suppress_token_ids": (self.begin_suppress_token_ids, num_output == 0),
            "min_tokens_stop_ids": (self.min_tokens_stop_ids, num_output < self.min_tokens[slots]),
            "logit_bias": (self.logit_bias_ids, always),
        }
        out = {}
        for name, (table, when) in active.items():
            rows = np.flatnonzero(when & (table.lengths[slots] > 0))
            if len(rows):
                out[name] = rows
        return out

    def step_forced_tokens(self, slots: np.ndarray, num_output: np.ndarray) -> np.ndarray | None:
        """[n] the only token allowed this step (-1: none), or None when no row has one."""
        forced = np.full(len(slots), -1, dtype=np.int64)
        has_forced = self.forced_positions.lengths[slots] > 0
        if has_forced.any():
            positions = self.forced_positions.ids[slots]  # [n, width]
            matches = (positions == num_output[:, None]) & has_forced[:, None]
            first = matches.argmax(axis=1)
            tokens = self.forced_tokens.ids[slots, first]
            forced = np.where(matches.any(axis=1), tokens, forced)
        forced_eos = self.forced_eos_token_id[slots]
        max_output = self.max_output_tokens[slots]
        is_last = (forced_eos >= 0) & (max_output > 0) & (num_output == max_output - 1)
        forced = np.where(is_last, forced_eos, forced)
        return forced if bool((forced >= 0).any()) else None

    def _position_generators(
        self, slots: np.ndarray, is_random: np.ndarray
    ) -> dict[int, torch.Generator]:
        """Seeds each seeded random row's generator for the output index it samples now."""
        generators = {}
        if not self.seeds:
            return generators
        for row in np.flatnonzero(is_random).tolist():
            slot = int(slots[row])
            if slot in self.seeds:
                generator = self.generators[slot]
                generator.manual_seed(
                    step_seed(self.seeds[slot], int(self.num_output_tokens[slot]))
                )
                generators[row] = generator
        return generators


def whisper_rule_metadata(
    state: torch.Tensor, rows: torch.Tensor, is_first: torch.Tensor, info: WhisperTokenInfo
) -> WhisperTimestampMetadata:
    """The timestamp rules' inputs from the rows' device state [k, NUM_I] (`iparams_dev`)."""
    flags = state[:, _I_FLAGS]
    last = (flags & _FLAG_LAST_IS_TS) != 0
    penultimate = (flags & _FLAG_PENULTIMATE_IS_TS) != 0
    last_timestamp = state[:, _I_LAST_TS]
    # transformers: after a lone timestamp the same value may repeat (closing the pair),
    # otherwise the next timestamp must be strictly larger.
    min_timestamp = torch.where(last & ~penultimate, last_timestamp, last_timestamp + 1)
    min_timestamp = torch.where(last_timestamp >= 0, min_timestamp, info.timestamp_begin)
    return WhisperTimestampMetadata(
        info=info,
        rows=rows,
        is_first=is_first,
        block_timestamps=last & penultimate,
        block_text=last & ~penultimate,
        min_timestamp=min_timestamp,
    )


def next_whisper_state(
    state: torch.Tensor, tokens: torch.Tensor, had_output: torch.Tensor, info: WhisperTokenInfo
) -> torch.Tensor:
    """The rows' timestamp state [k, NUM_I] after appending `tokens` [k]."""
    is_timestamp = tokens >= info.timestamp_begin
    flags = state[:, _I_FLAGS]
    penultimate = ~had_output | ((flags & _FLAG_LAST_IS_TS) != 0)
    state = state.clone()
    state[:, _I_FLAGS] = (
        is_timestamp.long() * _FLAG_LAST_IS_TS + penultimate.long() * _FLAG_PENULTIMATE_IS_TS
    )
    state[:, _I_LAST_TS] = torch.where(is_timestamp, tokens, state[:, _I_LAST_TS])
    return state


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
