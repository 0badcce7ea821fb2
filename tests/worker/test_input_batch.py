"""The persistent batch's step delta: a step's new requests enter, and its finished ones
leave, in one call each (slots, counters and token rows as one request at a time left them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v1.core.sched_output import NewRequestData
from v1.pooling_params import PoolingParams
from v1.worker.input_batch import InputBatch


def make_new_reqs(lengths: list[int], prefix: str = "r") -> list[NewRequestData]:
    """Pooling requests of `lengths` tokens whose ids tell request and position apart."""
    return [
        NewRequestData(
            req_id=f"{prefix}{i}",
            prompt_token_ids=[1000 * i + j for j in range(n)],
            output_token_ids=[],
            sampling_params=None,
            pooling_params=PoolingParams(),
            block_ids=(),
            num_computed_tokens=0,
        )
        for i, n in enumerate(lengths)
    ]


def test_new_requests_take_free_slots_with_their_tokens_and_counters() -> None:
    batch = InputBatch(max_num_reqs=8, max_model_len=16)
    new_reqs = make_new_reqs([3, 16, 1])
    states = batch.add_requests(new_reqs)
    assert [s.slot for s in states] == [0, 1, 2]  # the order one add at a time gave
    assert [s.req_id for s in states] == ["r0", "r1", "r2"]
    for state, data in zip(states, new_reqs, strict=True):
        n = len(data.prompt_token_ids)
        assert batch.requests[data.req_id] is state and state.num_prompt_tokens == n
        assert batch.token_ids[state.slot, :n].tolist() == data.prompt_token_ids
    np.testing.assert_array_equal(batch.num_tokens[:4], [3, 16, 1, 0])
    np.testing.assert_array_equal(batch.slot_generations[:4], [1, 1, 1, 0])


def test_finished_requests_free_their_slots_for_the_next_ones() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=8)
    batch.add_requests(make_new_reqs([2, 3, 4]))
    batch.pending_positions[:3] = 5
    removed = batch.remove_requests(["r1", "unknown", "r2"])
    assert [s.req_id for s in removed] == ["r1", "r2"] and set(batch.requests) == {"r0"}
    np.testing.assert_array_equal(batch.num_tokens[:3], [2, 0, 0])
    np.testing.assert_array_equal(batch.pending_positions[:3], [5, -1, -1])
    states = batch.add_requests(make_new_reqs([1, 1, 1], prefix="s"))
    assert sorted(s.slot for s in states) == [1, 2, 3]  # the freed slots, then a fresh one
    assert batch.slot_generations[[1, 2, 3]].tolist() == [2, 2, 1]
    assert batch.remove_requests([]) == []


def test_a_request_past_max_model_len_changes_nothing() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=8)
    with pytest.raises(ValueError, match="9 tokens exceed max_model_len=8"):
        batch.add_requests(make_new_reqs([2, 9]))
    assert not batch.requests and not batch.num_tokens.any()
    assert [s.slot for s in batch.add_requests(make_new_reqs([8]))] == [0]
    with pytest.raises(AssertionError, match="already in the batch"):
        batch.add_requests(make_new_reqs([1]))


@pytest.mark.parametrize("steps_in_flight", [2, 3])
def test_pending_inputs_read_the_launched_step_that_samples_them(steps_in_flight: int) -> None:
    """Step 1 samples for slots 0-2, step 2 for slots 0 and 2 only. The next step's inputs
    read slot 0's and 2's tokens from step 2 and, three steps deep, slot 1's from step 1 (at
    depth 2 step 1 is read back by then, so slot 1 has nothing pending)."""
    batch = InputBatch(max_num_reqs=4, max_model_len=16, steps_in_flight=steps_in_flight)
    batch.add_requests(make_new_reqs([2, 3, 4]))
    slots = np.array([0, 1, 2])
    step1 = torch.tensor([10, 11, 12])
    batch.mark_pending(slots, np.arange(3), step1)
    step1[:] = -1  # a sampler graph's buffer, overwritten by its next replay
    step2 = torch.tensor([20, 22])
    batch.mark_pending(np.array([0, 2]), np.array([0, 1]), step2)
    if steps_in_flight == 2:
        batch.resolve_pending(np.array([1]), np.array([3]), np.array([11]))
    computed = batch.num_tokens[slots] - 1  # each feeds its last token
    qsl = np.arange(4)
    dst, src = batch.pending_inputs(slots, computed, computed + 1, qsl)
    values = batch.pending_source()[torch.from_numpy(src)].tolist()
    if steps_in_flight == 2:  # slot 1's token is on the host: two pending inputs
        assert dst.tolist() == [0, 2] and values == [20, 22]
    else:
        assert dst.tolist() == [0, 1, 2] and values == [20, 11, 22]
    # Only the latest step: its tensor itself, no concatenation.
    dst, src = batch.pending_inputs(np.array([0, 2]), computed[[0, 2]], computed[[0, 2]] + 1, qsl)
    assert batch.pending_source() is batch.sampled[-1] and src.tolist() == [0, 1]
