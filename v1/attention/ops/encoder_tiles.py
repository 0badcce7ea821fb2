"""The tile table of the encoder-only attention kernel (`triton_encoder_attention.py`): which
sequence and query block each program takes, made on the device from a step's offsets, in
plain torch (no Triton needed to build or test it)."""

from __future__ import annotations

import torch


def query_tiles(cu_seqlens: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """[2, N] int32 (sequence, query block) of every tile of `block_m` query rows, computed on
    the device from the offsets (so a CUDA graph recomputes it at each replay). N =
    cdiv(num_rows, block_m) + S bounds the tiles of any S sequences over num_rows rows; spare
    tiles name sequence S."""
    num_seqs = cu_seqlens.shape[0] - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    blocks = (lens + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    index = torch.arange(
        -(-num_rows // block_m) + num_seqs, device=cu_seqlens.device, dtype=ends.dtype
    )
    seq = torch.searchsorted(ends, index, right=True)
    first = (ends - blocks)[seq.clamp(max=num_seqs - 1)]
    return torch.stack([seq, index - first]).to(torch.int32)
