"""StepInputs: one step's packed inputs in batch order, built by the runner from the persistent
batch and read by the model-kind states, the attention-metadata factory and the CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_PADDED_TOKENS = 64
PAD_TOKENS: bool | None = None
"""Whether eager steps pad their token count (None: on CUDA only, where it pays; tests set
True to drive the padded path on CPU)."""


def pads_tokens(device: torch.device) -> bool:
    return device.type == "cuda" if PAD_TOKENS is None else PAD_TOKENS


def padded_num_tokens(num_tokens: int) -> int:
    """The token count an eager CUDA step is padded to: at most 1/32 more, so the GEMMs' row
    counts repeat from step to step. A GEMM of a row count cuBLASLt has not seen costs a
    heuristic query of ~0.3-0.5 ms of host time (measured on an H100 host: 553 us per call of
    a [M, 768] x [768, 3072] linear with a new M each call, 20 us with M repeating); BERT's
    steps of ~31K packed tokens, a new count every step, paid ~12 ms per step for it."""
    if num_tokens <= MIN_PADDED_TOKENS:
        return num_tokens
    step = 1 << max(num_tokens.bit_length() - 6, 0)
    return -(-num_tokens // step) * step


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
    token_index: np.ndarray
    """[T] flat index of each token in the persistent batch's [slots, max_model_len] arrays."""
    positions_np: np.ndarray
    seq_lens: np.ndarray
    """[R] tokens in the sequence after this step."""
    input_ids: torch.Tensor
    """[T'] int64, T' >= T: eager CUDA steps are padded to `padded_num_tokens(T)` (padding rows
    attend to nothing and are cut from the hidden states after the main pass)."""
    positions: torch.Tensor
    """[T'] int64, padded like input_ids."""
    logits_indices: torch.Tensor
    """[R] index of each request's last scheduled token."""
    reached_end: np.ndarray
    """[R] bool: the step reaches the end of the request's known tokens (a token is sampled)."""
    input_lens: np.ndarray | None = None
    """[S] tokens of each sequence when a request packs several inputs (encoder-only: set by
    the state's `prepare_step`, with `positions` restarting at each); None: one sequence per
    request, `num_scheduled`."""
    input_counts: list[int] | None = None
    """With `input_lens`: per request, its packed inputs' count (0: not packed, one input)."""
    grammar_rows: np.ndarray | None = None
    """[k] batch rows whose next token a grammar constrains (structured outputs)."""
    grammar_bitmask: np.ndarray | None = None
    """[k, ceil(vocab / 32)] int32 packed masks of those rows (SchedulerOutput.grammar_bitmask)."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def sequence_lens(self) -> np.ndarray:
        """[S] tokens of each sequence the step attends within (packed inputs apart)."""
        return self.num_scheduled if self.input_lens is None else self.input_lens

    @property
    def input_offsets(self) -> np.ndarray:
        """[S + 1] token offsets of the sequences of `sequence_lens`."""
        if self.input_lens is None:
            return self.query_start_loc
        offsets = np.zeros(len(self.input_lens) + 1, dtype=np.int64)
        np.cumsum(self.input_lens, out=offsets[1:])
        return offsets
