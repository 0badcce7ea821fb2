"""`SamplingState`: the per-slot sampling state of the runner's batch, composed of one state
per rule (v1/sample/states/), and the per-step metadata the Sampler reads. Device rows change
only when a request enters or leaves (flushed at the next step); values that depend on sampled
tokens are updated on the device, so steps can be built before earlier tokens reach the host."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from v1.sample.metadata import SamplingMetadata
from v1.sample.states.params import ParamsState
from v1.sample.states.penalties import PenaltiesState
from v1.sample.states.slots import SlotRequest, StepRows
from v1.sample.states.token_tables import TokenTablesState
from v1.sample.states.whisper_timestamps import WhisperTimestampsState, WhisperTokenInfo
from v1.sampling_params import SamplingParams


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
        self.timestamps = WhisperTimestampsState(max_num_reqs, self.device, whisper)
        self.params = ParamsState(max_num_reqs, self.device, seed)
        self.penalties = PenaltiesState(max_num_reqs, max_model_len, self.device)
        self.token_tables = TokenTablesState(max_num_reqs, self.device)
        self._states = (self.timestamps, self.params, self.penalties, self.token_tables)
        """`add` runs in this order; the first may refuse a request before any state changes."""

        self.active = np.zeros(max_num_reqs, dtype=bool)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_output_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Counts are host-known even while the sampled values are still on the device."""
        self.needs_general_sampler = np.zeros(max_num_reqs, dtype=bool)
        """Per slot: a rule the fixed-shape sampler (v1/sample/graphed.py) does not have."""

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
        limit = max_output_tokens if max_output_tokens is not None else params.max_tokens
        room = self.max_model_len - num_prompt
        request = SlotRequest(
            params=params,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            eos_token_id=eos_token_id,
            max_output_tokens=room if limit is None else min(limit, room),
        )
        for state in self._states:
            state.add(slot, request)
        self.active[slot] = True
        self.num_prompt_tokens[slot] = num_prompt
        self.num_output_tokens[slot] = num_output
        self.needs_general_sampler[slot] = any(
            state.needs_general_sampler(params) for state in self._states
        )

    def remove_request(self, slot: int) -> None:
        """Frees `slot`; its parameters go back to neutral values."""
        for state in self._states:
            state.remove(slot)
        self.active[slot] = False
        self.num_prompt_tokens[slot] = 0
        self.num_output_tokens[slot] = 0
        self.needs_general_sampler[slot] = False

    def flush(self) -> None:
        """Writes the rows of requests that entered or left since the last step to the device;
        steps already launched keep reading the old rows."""
        for state in self._states:
            state.flush()

    # ---- per step ----
    def _step(self, slots: np.ndarray) -> StepRows:
        return StepRows(slots, self.num_prompt_tokens[slots], self.num_output_tokens[slots])

    def append_output_tokens(
        self,
        slots: np.ndarray | torch.Tensor | Sequence[int],
        token_ids: torch.Tensor | Sequence[int],
    ) -> None:
        """Records one new output token for each listed slot. `token_ids` may be a device tensor
        not computed yet: the history and Whisper state are updated on the device, in stream
        order; only the counts change on the host."""
        if torch.is_tensor(slots):
            slots = slots.cpu()  # sync: only when a caller passes device slots (tests)
        slots = np.asarray(slots).astype(np.int64).reshape(-1)
        if not len(slots):
            return
        assert bool(self.active[slots].all())
        step = self._step(slots)
        positions = step.num_prompt_tokens + step.num_output_tokens
        assert bool((positions < self.max_model_len).all()), "token history is full"
        self.flush()
        step.stage("positions", positions)
        ts_rows = self.timestamps.stage_append(step)
        step.ship(self.device)
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).to(self.device).reshape(-1)
        self.penalties.append(step.idx, step["positions"], tokens)
        self.timestamps.append(step, ts_rows, tokens)
        self.num_output_tokens[slots] += 1

    def count_output_tokens(self, slots: np.ndarray) -> None:
        """One new output token for each listed slot whose history and Whisper state the
        fixed-shape sampler already updated on the device (its requests read no history)."""
        assert bool(self.active[slots].all())
        self.num_output_tokens[slots] += 1

    def make_metadata(self, slots: Sequence[int] | np.ndarray) -> SamplingMetadata:
        """Metadata for a step whose logits row i belongs to slots[i]. Reads only host-known
        counts and flags (one packed copy to the device); sampled values are read on the device."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        assert bool(self.active[slots].all()), "make_metadata on a free slot"
        self.flush()
        step = self._step(slots)
        self.params.stage(step)
        penalties = self.penalties.stage(step)
        token_tables = self.token_tables.stage(step)
        whisper = self.timestamps.stage(step)
        step.ship(self.device)  # one pinned copy of every state's host arrays
        return SamplingMetadata(
            num_reqs=len(slots),
            params=self.params.metadata(step),
            penalties=None if penalties is None else penalties(),
            token_tables=None if token_tables is None else token_tables(),
            whisper=None if whisper is None else whisper(),
        )
