"""The persistent input batch: per-request state kept by the runner across steps.

Requests live in slots (rows) from admission to finish; each SchedulerOutput only adds, removes
or advances them. Step inputs are gathered from these arrays with vectorized numpy indexing.
The block tables of the same slots belong to the AttentionMetadataFactory (attn_metadata.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from v1.core.protocol import EncoderInput
from v1.core.sched_output import NewRequestData
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    slot: int
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    encoder_input: EncoderInput | None
    token_type_ids: list[int] | None
    num_prompt_tokens: int


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, steps_in_flight: int = 2) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_encoder_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """Cross-attention key length per slot (encoder-decoder models)."""
        self.pending_positions = np.full(max_num_reqs, -1, dtype=np.int64)
        """Per slot: position of the token the last launched step is sampling for it (-1:
        none). Its value is on the device until that step is read back."""
        self.pending_rows = np.full(max_num_reqs, -1, dtype=np.int64)
        """Per slot: that token's row in its step's sampled tensor."""
        self.pending_steps = np.full(max_num_reqs, -1, dtype=np.int64)
        """Per slot: the launch number of that step (see `sampled`)."""
        self.num_launched = 0
        """Steps that marked tokens pending so far (launch numbers count from 1)."""
        self.sampled: deque[torch.Tensor] = deque(maxlen=max(steps_in_flight - 1, 1))
        """[R] tokens sampled by the last launched steps, oldest first, on the device: the
        steps still in flight when the next one is prepared (pipelined steps). Beyond one
        step they are copies: a sampler graph's output buffer is overwritten by its next
        replay."""
        self.copy_sampled = steps_in_flight > 2
        self.continues_step = False
        """Set by the runner for the later steps of a decode burst: their sampled tokens take
        the place of the burst's earlier ones in `sampled` (every row is sampled again, so no
        pending token refers to those), keeping one entry per launched engine step."""
        self._pending_oldest = 0
        """Index in `sampled` of the oldest step the last `pending_inputs` rows read."""
        self.lora_slots = np.full(max_num_reqs, -1, dtype=np.int64)
        """Per batch slot: the device slot of the request's LoRA adapter (-1: none; the
        runner sets it when LoRA is enabled)."""
        self.slot_generations = np.zeros(max_num_reqs, dtype=np.int64)
        """Per slot: how many requests have held it, so results of a launched step can tell
        whether the slot still belongs to the same request (vectorized)."""
        self.requests: dict[str, CachedRequestState] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def add_requests(self, new_reqs: list[NewRequestData]) -> list[CachedRequestState]:
        """A step's new requests, each in a free slot (in `new_reqs` order); lengths are
        checked before anything changes. The per-slot counters are written once for the whole
        list: an encoder-only step brings ~100 new requests, and numpy scalar writes per
        request cost more than their token rows."""
        num = len(new_reqs)
        if num > len(self._free_slots):
            raise AssertionError(f"{num} new requests, {len(self._free_slots)} free slots")
        num_prompt = np.fromiter((len(d.prompt_token_ids) for d in new_reqs), np.int64, num)
        num_tokens = num_prompt + np.fromiter(
            (len(d.output_token_ids) for d in new_reqs), np.int64, num
        )
        too_long = np.flatnonzero(num_tokens > self.max_model_len)
        if len(too_long):
            n = int(num_tokens[too_long[0]])
            raise ValueError(f"{n} tokens exceed max_model_len={self.max_model_len}")
        slot_list = self._free_slots[len(self._free_slots) - num :][::-1]  # num pops, in order
        del self._free_slots[len(self._free_slots) - num :]
        states = [self._add(data, slot) for data, slot in zip(new_reqs, slot_list, strict=True)]
        slots = np.array(slot_list, dtype=np.int64)
        self.slot_generations[slots] += 1
        self.num_tokens[slots] = num_tokens
        self.num_computed_tokens[slots] = [d.num_computed_tokens for d in new_reqs]
        self.num_encoder_tokens[slots] = [
            0 if d.encoder_input is None else d.encoder_input.num_encoder_tokens for d in new_reqs
        ]
        return states

    def _add(self, data: NewRequestData, slot: int) -> CachedRequestState:
        """One new request's token row and state (add_requests writes its counters)."""
        if data.req_id in self.requests:
            raise AssertionError(f"request {data.req_id} already in the batch")
        prompt, output = data.prompt_token_ids, data.output_token_ids
        num_prompt = len(prompt)
        # Two row writes instead of joining the lists first (most requests have no outputs).
        self.token_ids[slot, :num_prompt] = prompt
        if output:
            self.token_ids[slot, num_prompt : num_prompt + len(output)] = output
        state = CachedRequestState(
            req_id=data.req_id,
            slot=slot,
            sampling_params=data.sampling_params,
            pooling_params=data.pooling_params,
            encoder_input=data.encoder_input,
            token_type_ids=data.token_type_ids,
            num_prompt_tokens=num_prompt,
        )
        self.requests[data.req_id] = state
        return state

    def remove_requests(self, req_ids: Iterable[str]) -> list[CachedRequestState]:
        """Frees the slots of the listed requests that are in the batch (others are ignored)
        and returns their states, in `req_ids` order."""
        pop = self.requests.pop
        states = [state for req_id in req_ids if (state := pop(req_id, None)) is not None]
        if states:
            slot_list = [state.slot for state in states]
            slots = np.array(slot_list, dtype=np.int64)
            self.num_tokens[slots] = 0
            self.pending_positions[slots] = -1
            self.lora_slots[slots] = -1
            self._free_slots.extend(slot_list)
        return states

    def mark_pending(
        self, slots: np.ndarray, rows: np.ndarray, sampled_token_ids: torch.Tensor
    ) -> np.ndarray:
        """One new token per listed slot, sampled as `rows` of `sampled_token_ids` (the step
        just launched, on the device; the next step reads its inputs there); its value comes
        to the host with `resolve_pending`. Returns the tokens' positions."""
        kept = sampled_token_ids.clone() if self.copy_sampled else sampled_token_ids
        if self.continues_step and self.sampled:
            self.sampled[-1] = kept
        else:
            self.num_launched += 1
            self.sampled.append(kept)
        positions = self.num_tokens[slots].copy()
        self.num_tokens[slots] += 1
        self.pending_positions[slots] = positions
        self.pending_rows[slots] = rows
        self.pending_steps[slots] = self.num_launched
        return positions

    def resolve_pending(
        self, slots: np.ndarray, positions: np.ndarray, token_ids: np.ndarray
    ) -> None:
        """The sampled values of tokens marked pending (slots still held by their request)."""
        self.token_ids[slots, positions] = token_ids
        done = self.pending_positions[slots] == positions
        self.pending_positions[slots[done]] = -1

    def token_index(self, token_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat index of each (slot, position) pair in the [max_num_reqs, max_model_len]
        per-token arrays: a 1-D `take` by it gathers a step's tokens 2-3x faster than 2-D
        fancy indexing."""
        index = token_slots * self.max_model_len
        index += positions
        return index

    def pending_inputs(
        self, slots: np.ndarray, computed: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(token index in the step, row in `pending_source(...)`) of every input token whose
        value is still on the device."""
        pending = self.pending_positions[slots]
        hit = (pending >= computed) & (pending < seq_lens)
        reqs = np.flatnonzero(hit)
        held = slots[reqs]
        rows = self.pending_rows[held]
        self._pending_oldest = len(self.sampled) - 1
        if len(self.sampled) > 1 and len(reqs):
            # Rows of the older steps in flight: offsets into the steps' concatenation.
            first = self.num_launched - len(self.sampled) + 1
            back = self.pending_steps[held] - first
            self._pending_oldest = int(back.min())
            assert self._pending_oldest >= 0, "a pending token's step is no longer kept"
            sizes = np.array([t.shape[0] for t in self.sampled], dtype=np.int64)
            starts = np.cumsum(sizes) - sizes
            rows = rows + starts[back] - starts[self._pending_oldest]
        return query_start[reqs] + pending[reqs] - computed[reqs], rows

    def pending_source(self) -> torch.Tensor:
        """The device tensor the rows of the last `pending_inputs` index: the last launched
        step's sampled tokens, or the concatenation of the kept steps from the oldest one
        those rows need."""
        if self._pending_oldest == len(self.sampled) - 1:
            return self.sampled[-1]
        return torch.cat(list(self.sampled)[self._pending_oldest :])
