"""Pieces every per-rule sampling state shares: the request a slot takes, the rows of one step
(with the host arrays its states ship in ONE pinned copy, by name) and token-id tables.
What must hold: device rows change only in `flush()` (stream-ordered), never mid-step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from v1.host_copy import to_device
from v1.sampling_params import SamplingParams

TABLE_COLUMNS = 64
"""Token-id tables grow by this many columns."""


@dataclass
class RowTokenIds:
    """A token id list per row, for the rows of the batch one rule is active for."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    token_ids: torch.Tensor
    """[k, width] int64, padded with -1."""


@dataclass(frozen=True)
class SlotRequest:
    """What a request brings to its slot (new, or resumed with its earlier outputs)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    max_output_tokens: int
    """Output limit for forced_eos_token_id (-1: none), capped by max_model_len."""


class StepRows:
    """The rows of one step (row i belongs to `slots[i]`), their host-known token counts, and
    the small int64 arrays the states need on the device, shipped together by `ship`."""

    def __init__(
        self, slots: np.ndarray, num_prompt_tokens: np.ndarray, num_output_tokens: np.ndarray
    ) -> None:
        self.slots = slots
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self._host: dict[str, np.ndarray] = {"slots": slots}
        self._dev: dict[str, torch.Tensor] = {}

    def stage(self, name: str, array: np.ndarray) -> None:
        assert not self._dev, "staged after ship"
        self._host[name] = np.asarray(array, dtype=np.int64).reshape(-1)

    def ship(self, device: torch.device) -> None:
        parts = list(self._host.values())
        flat = to_device(np.concatenate(parts), device)
        self._dev = dict(zip(self._host, flat.split([len(p) for p in parts]), strict=True))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._dev[name]

    @property
    def idx(self) -> torch.Tensor:
        """[n] int64 slots on the device."""
        return self._dev["slots"]


class TokenIdTable:
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
            width = -(-num_ids // TABLE_COLUMNS) * TABLE_COLUMNS
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
            push_rows(self.dev, self.ids, self._dirty)
        self._dirty.clear()

    def rows(self, idx: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """[k, width of the longest of these lists] on the device."""
        width = int(self.lengths[slots].max()) if len(slots) else 0
        return self.dev[idx, :width]


def push_rows(dev: torch.Tensor, host: np.ndarray, rows: set[int]) -> None:
    """dev[rows] = host[rows]: one pinned copy of the rows, scattered on the device."""
    index = np.fromiter(rows, dtype=np.int64, count=len(rows))
    dev[to_device(index, dev.device)] = to_device(host[index], dev.device)
