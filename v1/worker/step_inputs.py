"""StepInputs: one step's packed inputs in batch order, built by the runner from the persistent
batch and read by the model-kind states, the attention-metadata factory and the CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepInputs:
    """One step's packed decoder (or encoder-only) inputs, requests in batch order."""

    req_ids: list[str]
    slots: np.ndarray
    num_scheduled: np.ndarray
    query_start_loc: np.ndarray
    """[R + 1] token offsets."""
    token_slots: np.ndarray
    """[T] slot of each token."""
    positions_np: np.ndarray
    seq_lens: np.ndarray
    """[R] tokens in the sequence after this step."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    """[R] index of each request's last scheduled token."""
    reached_end: np.ndarray
    """[R] bool: the step reaches the end of the request's known tokens (a token is sampled)."""
    grammar_rows: np.ndarray | None = None
    """[k] batch rows whose next token a grammar constrains (structured outputs)."""
    grammar_bitmask: np.ndarray | None = None
    """[k, ceil(vocab / 32)] int32 packed masks of those rows (SchedulerOutput.grammar_bitmask)."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])
