"""Per-slot token-id tables: allowed ids, suppress / begin-suppress ids, min_tokens' stop ids,
logit bias, forced tokens (forced_token_ids, forced_eos_token_id). Which rows a table applies to
on a step follows from host-known token counts; the ids are read on the device."""

from __future__ import annotations

import numpy as np
import torch

from v1.sample.metadata import RowLogitBias, RowTokenIds, SamplingMetadata
from v1.sample.states.slots import TABLE_COLUMNS, Fill, SlotRequest, StepRows, TokenIdTable
from v1.sampling_params import SamplingParams

_BAN_TABLE_WIDTH = 128
"""Initial width of the suppress-token table (Whisper's list has ~90 ids)."""


class TokenTablesState:
    """The token-id tables of the slots and the counts that switch them on and off."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.allowed_token_ids = TokenIdTable(max_num_reqs, device)
        self.suppress_token_ids = TokenIdTable(max_num_reqs, device, width=_BAN_TABLE_WIDTH)
        self.begin_suppress_token_ids = TokenIdTable(max_num_reqs, device, width=TABLE_COLUMNS)
        """Banned on the first output token only."""
        self.min_tokens_stop_ids = TokenIdTable(max_num_reqs, device, width=TABLE_COLUMNS)
        """EOS (unless ignore_eos) and stop ids, banned while under min_tokens."""
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.logit_bias_ids = TokenIdTable(max_num_reqs, device)
        self.logit_bias_values = TokenIdTable(max_num_reqs, device, np.float32, 0.0)
        """A sparse bias per slot: token ids and, in the same columns, their biases."""
        self.forced_positions = TokenIdTable(max_num_reqs, device)
        self.forced_tokens = TokenIdTable(max_num_reqs, device)
        """forced_token_ids: output index -> the only token allowed there."""
        self.forced_eos_token_id = np.full(max_num_reqs, -1, dtype=np.int64)
        self.max_output_tokens = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no limit known here (no forced EOS)."""
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

    @staticmethod
    def needs_general_sampler(params: SamplingParams) -> bool:
        """Allowed ids and logit bias are not in the fixed-shape sampler."""
        return bool(params.allowed_token_ids) or bool(params.logit_bias)

    def add(self, slot: int, request: SlotRequest) -> None:
        params = request.params
        for table, token_ids in (
            (self.allowed_token_ids, params.allowed_token_ids),
            (self.suppress_token_ids, params.suppress_tokens),
            (self.begin_suppress_token_ids, params.begin_suppress_tokens),
        ):
            if token_ids:
                table.set(slot, token_ids)
        if params.logit_bias:
            self.logit_bias_ids.set(slot, list(params.logit_bias))
            self.logit_bias_values.set(slot, list(params.logit_bias.values()))
        self.min_tokens[slot] = params.min_tokens
        stop_ids = list(params.all_stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(request.eos_token_id)
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens_stop_ids.set(slot, stop_ids)
        if params.forced_token_ids:
            self.forced_positions.set(slot, [index for index, _ in params.forced_token_ids])
            self.forced_tokens.set(slot, [token for _, token in params.forced_token_ids])
        eos = params.forced_eos_token_id
        self.forced_eos_token_id[slot] = -1 if eos is None else eos
        self.max_output_tokens[slot] = request.max_output_tokens

    def remove(self, slot: int) -> None:
        for table in self._tables:
            table.clear(slot)
        self.min_tokens[slot] = 0
        self.forced_eos_token_id[slot] = -1
        self.max_output_tokens[slot] = -1

    def flush(self) -> None:
        for table in self._tables:
            table.flush()

    def stage(self, step: StepRows) -> Fill | None:
        slots = step.slots
        rules = self._rule_rows(slots, step.num_output_tokens)
        for name, rows in rules.items():
            step.stage(f"tables.{name}", rows)
        forced = self.forced_tokens_at(slots, step.num_output_tokens)
        if forced is not None:
            step.stage("tables.forced", forced)
        if not rules and forced is None:
            return None

        def fill(metadata: SamplingMetadata) -> None:
            idx = step.idx
            for name, table in (
                ("allowed_token_ids", self.allowed_token_ids),
                ("suppress_token_ids", self.suppress_token_ids),
                ("begin_suppress_token_ids", self.begin_suppress_token_ids),
                ("min_tokens_stop_ids", self.min_tokens_stop_ids),
            ):
                if name in rules:
                    rows = step[f"tables.{name}"]
                    token_ids = table.rows(idx[rows], slots[rules[name]])
                    setattr(metadata, name, RowTokenIds(rows=rows, token_ids=token_ids))
            if "logit_bias" in rules:
                rows = step["tables.logit_bias"]
                width = int(self.logit_bias_ids.lengths[slots[rules["logit_bias"]]].max())
                metadata.logit_bias = RowLogitBias(
                    rows=rows,
                    token_ids=self.logit_bias_ids.dev[idx[rows], :width],
                    biases=self.logit_bias_values.dev[idx[rows], :width],
                )
            if forced is not None:
                metadata.forced_token_ids = step["tables.forced"]

        return fill

    def _rule_rows(self, slots: np.ndarray, num_output: np.ndarray) -> dict[str, np.ndarray]:
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

    def forced_tokens_at(self, slots: np.ndarray, num_output: np.ndarray) -> np.ndarray | None:
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
