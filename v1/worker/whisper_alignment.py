"""Whisper token timing from cross-attention (openai-whisper's `find_alignment`): the alignment
heads' attention over the window's frames, normalized per frame across tokens, median-filtered
along time and averaged over heads, is aligned to the tokens by dynamic time warping; where
the path moves to the next token is that token's start time.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SECONDS_PER_POSITION = 0.02
"""One encoder position (two 10 ms mel frames)."""
MEDIAN_FILTER_WIDTH = 7


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of odd `width` along the last dim, edges reflected (the
    filter openai-whisper and transformers apply); too short a dim is returned unchanged."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    padded = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")  # [N, 1, L + 2p]
    windows = padded.reshape(-1, shape[-1] + 2 * pad).unfold(-1, width, 1)  # [N, L, width]
    return windows.median(dim=-1).values.reshape(shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotone path through `cost` [N, M] from (0, 0) to (N-1, M-1) minimizing the summed
    cost, moves (1, 1), (1, 0) and (0, 1) -> (row index, column index) of each step.

    Ties prefer the diagonal only when it is strictly best, then the row step, else the
    column step (as openai-whisper and transformers). The accumulated cost is filled one
    anti-diagonal at a time (each depends only on the two before it), vectorized."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(step, (c0, c1, c2))
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    rows, cols = [], []
    i, j = n, m
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def alignment_matrix(
    weights: torch.Tensor, num_frames: int, first_row: int, filter_width: int = MEDIAN_FILTER_WIDTH
) -> torch.Tensor:
    """Alignment-head attention [heads, T, S] of a teacher-forced pass over
    `sot sequence, <|notimestamps|>, text tokens, <|endoftext|>` -> the DTW score matrix
    [text tokens + 1, frames] (on the weights' device): its rows predict each text token and
    <|endoftext|>.

    `num_frames`: 10 ms mel frames of audio in the window (attention beyond them is padding);
    `first_row`: position of <|notimestamps|>, whose row predicts the first text token."""
    weights = weights[:, :, : max(num_frames // 2, 1)].float()
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, filter_width)
    return weights.mean(dim=0)[first_row:-1]


def boundaries(matrix: np.ndarray) -> list[float]:
    """DTW of an alignment matrix -> the start time (seconds from the window start) of each
    text token and of <|endoftext|>: where the path reaches its row."""
    rows, cols = dtw(-matrix.astype(np.float64))
    jumps = np.diff(rows, prepend=-1).astype(bool)
    return (cols[jumps] * SECONDS_PER_POSITION).tolist()


def token_boundaries(
    weights: torch.Tensor, num_frames: int, first_row: int, filter_width: int = MEDIAN_FILTER_WIDTH
) -> list[float]:
    """`boundaries` of `alignment_matrix` (len: number of text tokens + 1)."""
    matrix = alignment_matrix(weights, num_frames, first_row, filter_width)
    return boundaries(matrix.double().cpu().numpy())  # sync: the matrix reaches the host
