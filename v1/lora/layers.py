"""What LoRA attaches to each of our Linears (`Linear.lora`): the adapter slots' stacked A and
B on the device, and `LoRAIndices`, the per-row slot index buffers the runner fills each step
(one for decoder tokens, one for encoder rows) and every layer reads in place (CUDA graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from v1.lora.ops import add_lora
from v1.lora.targets import LoRATarget


class LoRAIndices:
    """Per-row adapter slots (-1: the base model) of the rows the model runs now."""

    def __init__(self, max_decoder_rows: int, max_encoder_rows: int, device: torch.device) -> None:
        self.device = device
        self.decoder = torch.full((max_decoder_rows,), -1, dtype=torch.int64, device=device)
        """Fixed size and address: CUDA graphs of decode steps read it."""
        self.encoder = torch.full((max_encoder_rows,), -1, dtype=torch.int64, device=device)
        self.rows_per_run = {False: 1.0, True: 1.0}
        """Per side (encoder_side), the mean length of the runs of one slot in the rows last
        set (host side, from `set`): long runs (the encoder's rows per request, prefill) take
        the tiled SGMV kernels, short ones (decode) BGMV (`ops.use_sgmv`). The decoder side
        starts at 1, so CUDA-graph warm-up and capture, before any step, both run BGMV."""

    def set(self, encoder_side: bool, slots: np.ndarray) -> None:
        """Rows 0..len(slots) get `slots`; the rest (padding) -1."""
        n = len(slots)
        runs = 1 + int(np.count_nonzero(slots[1:] != slots[:-1])) if n else 1
        self.rows_per_run[encoder_side] = max(n, 1) / runs
        buf = self.encoder if encoder_side else self.decoder
        if n > buf.shape[0]:
            assert encoder_side, f"{n} decoder rows exceed the LoRA index buffer"
            buf = self.encoder = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        src = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        buf[:n].copy_(src, non_blocking=True)
        buf[n:].fill_(-1)

    def rows(self, encoder_side: bool, num_rows: int) -> torch.Tensor:
        buf = self.encoder if encoder_side else self.decoder
        if num_rows > buf.shape[0]:  # eager only (a profiling pass): the rest run the base
            grown = torch.full((num_rows,), -1, dtype=torch.int64, device=self.device)
            grown[: buf.shape[0]] = buf
            return grown
        return buf[:num_rows]


class LoRALinear:
    """The adapter slots of one Linear: sub-projection j of slot s occupies A rows and B
    columns [j*R, j*R + r) and B rows of its output range; the rest stays zero (a smaller rank,
    or a sub-projection the adapter does not target, adds nothing)."""

    def __init__(
        self,
        target: LoRATarget,
        max_loras: int,
        max_rank: int,
        indices: LoRAIndices,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.target = target
        self.max_rank = max_rank
        self.indices = indices
        num_subs, out_size = len(target.output_sizes), sum(target.output_sizes)
        kwargs = {"dtype": dtype, "device": device}
        self.lora_a = torch.zeros(max_loras, num_subs * max_rank, target.input_size, **kwargs)
        self.lora_b = torch.zeros(max_loras, out_size, num_subs * max_rank, **kwargs)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        side = self.target.encoder_side
        indices = self.indices.rows(side, rows)
        return add_lora(
            out,
            x,
            self.lora_a,
            self.lora_b,
            indices,
            rows_per_run=self.indices.rows_per_run[side],
            sub_sizes=tuple(self.target.output_sizes),
        )

    def set_slot(self, slot: int, subs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes one adapter's (A, B) per sub-projection into `slot` (zeros elsewhere)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = np.cumsum((0, *self.target.output_sizes))
        for j, (a, b) in subs.items():
            r, col = a.shape[0], j * self.max_rank
            self.lora_a[slot, col : col + r].copy_(a)
            self.lora_b[slot, offsets[j] : offsets[j + 1], col : col + r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
