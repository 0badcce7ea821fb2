"""The token-timing math of word timestamps against transformers' own helpers: the vectorized
DTW takes the same path (ties included), the median filter gives the same values, and a
cross-attention that walks the frames yields the token boundaries it walks through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

from v1.worker.whisper_alignment import dtw, median_filter, token_boundaries


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (4, 30), (30, 4), (25, 300)])
def test_dtw_takes_transformers_path(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    cost = rng.standard_normal(shape)
    ties = np.round(cost, 0)  # many equal sums: the tie order decides the path
    for matrix in (cost, ties):
        rows, cols = dtw(matrix)
        ref_rows, ref_cols = _dynamic_time_warping(matrix)
        np.testing.assert_array_equal(rows, ref_rows)
        np.testing.assert_array_equal(cols, ref_cols)


@pytest.mark.parametrize("length", [2, 3, 4, 7, 50])
def test_median_filter_matches_transformers(length: int) -> None:
    x = torch.randn(3, 5, length, generator=torch.Generator().manual_seed(length))
    expected = _median_filter(x, 7) if length > 3 else x  # too short to reflect: unchanged
    torch.testing.assert_close(median_filter(x, 7), expected, rtol=0, atol=0)


def test_boundaries_follow_a_diagonal_attention() -> None:
    """Prompt rows (sot, language, task, <|notimestamps|>), 5 text tokens and EOS, over 100
    frames of audio padded to 1500 positions: text token k is attended at positions
    [10k, 10k + 10), so its start is 0.2k s; the padding beyond 100 frames is never reached."""
    num_text, num_prompt = 5, 4
    num_rows = num_prompt + num_text + 1
    weights = torch.full((2, num_rows, 1500), 1e-4)
    for k in range(num_text + 1):  # the row predicting text token k (EOS for k = num_text)
        row = num_prompt - 1 + k
        weights[:, row, 10 * k : 10 * k + 10] = 1.0
    weights = weights / weights.sum(-1, keepdim=True)
    times = token_boundaries(weights, num_frames=2 * 10 * (num_text + 1), first_row=num_prompt - 1)
    assert times == pytest.approx([0.2 * k for k in range(num_text + 1)])
