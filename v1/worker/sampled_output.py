"""A launched generation step's results on their way to the host (pipelined steps).

The sampled tokens stay on the device, where the next step reads them as inputs; one pinned,
non-blocking copy per step brings them (and logprobs, and model extras) to the host, and
`get_output` waits for that copy only: the one host sync of a generation step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from v1.core.sched_output import ModelRunnerOutput
from v1.worker.input_batch import InputBatch


class HostCopy:
    """Device tensors copied into pinned host memory when created (one pinned buffer for all
    of them); `get` waits for them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        on_device = {n: t for n, t in tensors.items() if t.is_cuda}
        self._host: dict[str, torch.Tensor] = {n: t for n, t in tensors.items() if not t.is_cuda}
        if not on_device:
            return
        # One pinned allocation (each costs host time), 8-byte aligned slices of it.
        offsets, total = [], 0
        for tensor in on_device.values():
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // 8) * 8
        buffer = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
        for (name, tensor), start in zip(on_device.items(), offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            host = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            self._host[name] = host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> dict[str, np.ndarray]:
        if self._event is not None:
            self._event.synchronize()  # sync: the step's sampled tokens reach the host
        # Copies: the pinned buffer goes back to torch's host cache right away.
        return {name: t.numpy().copy() for name, t in self._host.items()}


@dataclass
class PendingSampledStep:
    """A DeferredRunnerOutput of a generation step."""

    batch: InputBatch
    req_ids: list[str]
    keep_rows: np.ndarray
    """Rows that sampled a token (their step reached the end of the known tokens)."""
    slots: np.ndarray
    """Slot of each kept row."""
    generations: np.ndarray
    """`InputBatch.slot_generations` of those slots at launch: a slot reused since then
    belongs to another request, whose tokens must not be overwritten."""
    positions: np.ndarray
    """Sequence position of each kept row's token."""
    host: HostCopy
    num_logprobs: np.ndarray | None = None
    """Per row: logprobs asked for (-1: none); None when no row asks."""
    num_encoder_runs: int = 0
    finalize: list[Callable[[ModelRunnerOutput, dict[str, np.ndarray]], None]] = field(
        default_factory=list
    )
    """Model-kind hooks that add extras from the copied tensors (e.g. Whisper no-speech)."""

    def get_output(self) -> ModelRunnerOutput:
        data = self.host.get()
        sampled = data["sampled"]
        keep = np.zeros(len(self.req_ids), dtype=bool)
        keep[self.keep_rows] = True
        held = self.batch.slot_generations[self.slots] == self.generations
        self.batch.resolve_pending(
            self.slots[held], self.positions[held], sampled[self.keep_rows[held]]
        )
        result = ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[t] for t in sampled.tolist()]
            if len(self.keep_rows) == len(self.req_ids)
            else [[t] if k else [] for t, k in zip(sampled.tolist(), keep.tolist(), strict=True)],
            num_encoder_runs=self.num_encoder_runs,
        )
        if "lp" in data:
            self._add_logprobs(result, data, keep)
        for hook in self.finalize:
            hook(result, data)
        return result

    def _add_logprobs(
        self, result: ModelRunnerOutput, data: dict[str, Any], keep: np.ndarray
    ) -> None:
        assert self.num_logprobs is not None
        nums = self.num_logprobs
        wanted = (nums >= 0) & keep
        if wanted.all() and (nums == nums[0]).all():
            # Every row asked for the same number (the usual batch): whole-array slices.
            width = 1 + int(nums[0])
            result.logprob_token_ids = [[r] for r in data["lp_ids"][:, :width].tolist()]
            result.logprobs = [[r] for r in data["lp"][:, :width].tolist()]
            result.logprob_ranks = [[r] for r in data["ranks"].tolist()]
            return
        # One conversion of each array to Python lists, then per-row slices of those.
        ids, values = data["lp_ids"].tolist(), data["lp"].tolist()
        ranks = data["ranks"].tolist()
        token_ids: list[list[list[int]] | None] = []
        logprobs: list[list[list[float]] | None] = []
        logprob_ranks: list[list[int] | None] = []
        for i, (num, want) in enumerate(zip(nums.tolist(), wanted.tolist(), strict=True)):
            if not want:
                token_ids.append(None)
                logprobs.append(None)
                logprob_ranks.append(None)
                continue
            token_ids.append([ids[i][: 1 + num]])
            logprobs.append([values[i][: 1 + num]])
            logprob_ranks.append([int(ranks[i])])
        result.logprob_token_ids, result.logprobs = token_ids, logprobs
        result.logprob_ranks = logprob_ranks
