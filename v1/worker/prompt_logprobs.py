"""Prompt logprobs of a generation step: for the rows that ask, the logprob of each prompt token
(after the first) under the model, with the top-N tokens, from the step's hidden states.

A chunk of a prompt at positions [c, c + n) predicts the tokens at c + 1 .. c + n; only targets
inside the prompt count. Rows that resumed with outputs already reported theirs and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.core.sched_output import ModelRunnerOutput
from v1.host_copy import to_device

if TYPE_CHECKING:
    from v1.worker.step_inputs import StepInputs


class PromptLogprobsJob:
    """What one step computes: flat token indices and the rows they belong to."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.starts: list[int] = []
        """Per row: index of the first prompt token its logprobs cover."""
        self.counts: list[int] = []
        self.nums: list[int] = []
        """Per row: the top-N it asked for (the step computes the largest)."""

    def finalize(self, result: ModelRunnerOutput, data: dict[str, np.ndarray]) -> None:
        ids, values = data["prompt_lp_ids"], data["prompt_lp"]
        offset = 0
        for req_id, start, count, num in zip(
            self.req_ids, self.starts, self.counts, self.nums, strict=True
        ):
            rows = slice(offset, offset + count)
            result.prompt_logprobs[req_id] = (
                start,
                ids[rows, : 1 + num].tolist(),
                values[rows, : 1 + num].tolist(),
            )
            offset += count


def prompt_logprobs_job(
    step: StepInputs,
    token_ids: np.ndarray,
    num_prompt_logprobs: np.ndarray,
    num_prompt_tokens: np.ndarray,
    num_output_tokens: np.ndarray,
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[PromptLogprobsJob, dict[str, torch.Tensor]] | None:
    """The step's prompt logprobs as device tensors to copy to the host, or None when no row
    of the step asks for them. `token_ids` [slots, max_model_len] are the batch's tokens; the
    other arrays are per slot (SamplingState's host mirrors); `compute_logits`: hidden states
    [k, H] -> logits [k, vocab]."""
    slots = step.slots
    wants = (num_prompt_logprobs[slots] >= 0) & (num_output_tokens[slots] == 0)
    if not wants.any():
        return None
    qsl = step.query_start_loc
    job = PromptLogprobsJob()
    token_index, targets = [], []
    for row in np.flatnonzero(wants).tolist():
        slot = int(slots[row])
        positions = step.positions_np[qsl[row] : qsl[row + 1]]
        keep = positions + 1 < num_prompt_tokens[slot]
        if not keep.any():
            continue
        index = np.arange(qsl[row], qsl[row + 1])[keep]
        token_index.append(index)
        targets.append(token_ids[slot, positions[keep] + 1])
        job.req_ids.append(step.req_ids[row])
        job.starts.append(int(positions[keep][0]) + 1)
        job.counts.append(int(keep.sum()))
        job.nums.append(int(num_prompt_logprobs[slot]))
    if not job.req_ids:
        return None
    device = hidden_states.device
    index = to_device(np.concatenate(token_index), device)
    target = to_device(np.concatenate(targets), device).unsqueeze(1)  # [k, 1]
    logits = compute_logits(hidden_states[index]).float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [k, vocab]
    target_logprobs = logprobs.gather(1, target)
    top_logprobs, top_ids = logprobs.topk(max(job.nums), dim=-1)
    tensors: dict[str, Any] = {
        "prompt_lp_ids": torch.cat([target, top_ids], dim=1),
        "prompt_lp": torch.cat([target_logprobs, top_logprobs], dim=1),
    }
    return job, tensors
