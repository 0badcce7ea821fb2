"""Per-KV-group block tables of the persistent batch, and vectorized slot mappings."""

from __future__ import annotations

import numpy as np
import torch

from v1.host_copy import to_device


class BlockTable:
    """[max_num_reqs, max_num_blocks] int32 on the host; rows are persistent batch slots."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.table = np.zeros((max_num_reqs, max_num_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, slot: int, block_ids: list[int]) -> None:
        self.num_blocks[slot] = 0
        self.append_row(slot, block_ids)

    def append_row(self, slot: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[slot]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"request needs {end} blocks, table holds {self.table.shape[1]}")
        self.table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def clear_rows(self, slots: np.ndarray) -> None:
        self.num_blocks[slots] = 0

    def rows(self, slots: np.ndarray, device: torch.device) -> torch.Tensor:
        """Block table of this step's requests, [num_reqs, max blocks used] int32."""
        width = max(int(self.num_blocks[slots].max(initial=1)), 1)
        return to_device(self.table[slots, :width], device)

    def slot_mapping(self, token_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each (request slot, position) pair: block_id * block_size + offset."""
        block_ids = self.table[token_slots, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size

    def prefix_slot_mapping(self, slots: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Cache slots of positions 0 .. lengths[i] - 1 of each request slot, packed in order
        (what `slot_mapping` gives for those pairs): block by block, [R, blocks, block_size]
        from the table's [R, blocks] ids, without a per-position index (a Whisper step's 32
        cross-attention writers are 48,000 positions)."""
        bs = self.block_size
        width = -(-int(lengths.max(initial=0)) // bs)
        blocks = self.table[slots, :width].astype(np.int64)
        all_slots = (blocks[:, :, None] * bs + np.arange(bs)).reshape(len(slots), width * bs)
        if (lengths == lengths[0]).all():
            return all_slots[:, : int(lengths[0])].reshape(-1)
        return all_slots[np.arange(width * bs) < lengths[:, None]]
