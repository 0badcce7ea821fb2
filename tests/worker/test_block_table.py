"""BlockTable's slot mappings: whole-prefix writers (a Whisper step's cross-attention writes)
map to the slots the per-position mapping gives."""

from __future__ import annotations

import numpy as np
import pytest

from v1.worker.block_table import BlockTable


@pytest.mark.parametrize(
    "lengths",
    [[1500] * 32, [1500], [7, 16, 17, 1, 33], [16, 16], [1, 1500, 750]],
    ids=["whisper-step", "one", "ragged", "whole-blocks", "mixed"],
)
def test_prefix_slot_mapping_matches_per_position(lengths: list[int]) -> None:
    rng = np.random.default_rng(len(lengths))
    table = BlockTable(64, 100, 16)
    table.table[:] = rng.integers(0, 50_000, size=table.table.shape)
    slots = rng.choice(64, len(lengths), replace=False)
    lens = np.array(lengths, dtype=np.int64)
    positions = np.concatenate([np.arange(n) for n in lengths])
    want = table.slot_mapping(np.repeat(slots, lens), positions)
    got = table.prefix_slot_mapping(slots, lens)
    assert got.dtype == want.dtype == np.int64
    np.testing.assert_array_equal(got, want)
