"""Per-slot token-id tables: allowed ids, suppress / begin-suppress ids, min_tokens' stop ids,
logit bias, forced tokens (forced_token_ids, forced_eos_token_id). Which rows a table applies to
on a step follows from host-known token counts; the ids are read on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from v1.sample.states.slots import (
    TABLE_COLUMNS,
    RowTokenIds,
    SlotRequest,
    StepRows,
    TokenIdTable,
)
from v1.sampling_params import SamplingParams

_BAN_TABLE_WIDTH = 128
"""Initial width of the suppress-token table (Whisper's list has ~90 ids)."""
_NEG_INF = float("-inf")


@dataclass
class RowLogitBias:
    """A sparse additive bias per row, for the rows of the batch that have one."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    token_ids: torch.Tensor
    """[k, width] int64, padded with -1."""
    biases: torch.Tensor
    """[k, width] float32, the bias of each token id (0 in padding)."""


@dataclass
class TokenTablesMetadata:
    """A step's token-table rules; each covers only the rows it is active for."""

    logit_bias: RowLogitBias | None = None
    """Added to the logits after the penalties (OpenAI's logit_bias)."""
    allowed_token_ids: RowTokenIds | None = None
    suppress_token_ids: RowTokenIds | None = None
    begin_suppress_token_ids: RowTokenIds | None = None
    """Only rows about to sample their first output token."""
    min_tokens_stop_ids: RowTokenIds | None = None
    """EOS (unless ignore_eos) and stop_token_ids, only for rows still under min_tokens."""
    forced_token_ids: torch.Tensor | None = None
    """[n] int64: the only token allowed at this step, -1 for none (forced_token_ids and
    forced_eos_token_id merged; EOS wins when both apply, as in transformers)."""

    def apply(self, logits: torch.Tensor) -> None:
        """The bias (it moves values), then the allowed and banned ids, in place."""
        if self.logit_bias is not None:
            apply_logit_bias(logits, self.logit_bias)
        if self.allowed_token_ids is not None:
            apply_allowed_token_ids(logits, self.allowed_token_ids)
        for banned in (
            self.suppress_token_ids,
            self.begin_suppress_token_ids,
            self.min_tokens_stop_ids,
        ):
            if banned is not None:
                apply_banned_token_ids(logits, banned)

    def apply_forced(self, logits: torch.Tensor) -> None:
        """Forced tokens, in place; they override every other rule (so they run last)."""
        if self.forced_token_ids is not None:
            apply_forced_tokens(logits, self.forced_token_ids)


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

    def stage(self, step: StepRows) -> Callable[[], TokenTablesMetadata] | None:
        """Stages the step's host arrays; returns what builds its metadata once they shipped."""
        slots = step.slots
        rules = self._rule_rows(slots, step.num_output_tokens)
        for name, rows in rules.items():
            step.stage(f"tables.{name}", rows)
        forced = self.forced_tokens_at(slots, step.num_output_tokens)
        if forced is not None:
            step.stage("tables.forced", forced)
        if not rules and forced is None:
            return None

        def fill() -> TokenTablesMetadata:
            metadata = TokenTablesMetadata()
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
            return metadata

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


def token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, width] ids (-1 padding) -> [k, vocab] bool; ids outside the vocabulary are dropped."""
    spare = torch.where((token_ids < 0) | (token_ids >= vocab_size), vocab_size, token_ids)
    mask = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device
    )
    mask.scatter_(1, spare, True)
    return mask[:, :vocab_size]


def apply_allowed_token_ids(logits: torch.Tensor, allowed: RowTokenIds) -> None:
    """Only the listed tokens stay possible on the listed rows."""
    disallowed = ~token_mask(allowed.token_ids, logits.shape[1])
    logits[allowed.rows] = logits[allowed.rows].masked_fill(disallowed, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, bias: RowLogitBias) -> None:
    """Adds each listed row's sparse bias to its logits (padding ids -1 go to a spare column)."""
    vocab_size = logits.shape[1]
    ids = torch.where(
        (bias.token_ids < 0) | (bias.token_ids >= vocab_size), vocab_size, bias.token_ids
    )
    dense = torch.zeros(ids.shape[0], vocab_size + 1, dtype=logits.dtype, device=logits.device)
    dense.scatter_add_(1, ids, bias.biases.to(logits.dtype))
    logits[bias.rows] += dense[:, :vocab_size]


def apply_banned_token_ids(logits: torch.Tensor, banned: RowTokenIds) -> None:
    """The listed tokens become impossible on the listed rows."""
    mask = token_mask(banned.token_ids, logits.shape[1])
    logits[banned.rows] = logits[banned.rows].masked_fill(mask, _NEG_INF)


def apply_forced_tokens(logits: torch.Tensor, forced_token_ids: torch.Tensor) -> None:
    """Rows with a forced token (>= 0) get 0 there and -inf elsewhere (as transformers)."""
    forced = forced_token_ids.unsqueeze(1)  # [n, 1]
    vocab_ids = torch.arange(logits.shape[1], device=logits.device)
    is_forced_row = forced >= 0
    logits.masked_fill_(is_forced_row & (vocab_ids != forced), _NEG_INF)
    logits.masked_fill_(is_forced_row & (vocab_ids == forced), 0.0)
