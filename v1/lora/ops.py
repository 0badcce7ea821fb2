"""The batched LoRA product of one Linear: out[t] += B[s] (A[s] x[t]) for each token t with
adapter slot s = indices[t] (-1: the base model, nothing added). `lora_delta_reference` is the
plain-torch oracle; `add_lora` picks grouped matmuls per adapter on CPU, on CUDA the Triton
SGMV kernels (tiled matmuls; rows in long runs of one adapter: the encoder, prefill) or BGMV
(one program per row: decode rows, and every CUDA-graph capture), or (no Triton) a per-slot
masked form that never syncs (CUDA graphs).
"""

from __future__ import annotations

import torch


def lora_delta_reference(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """x [T, in], lora_a [S, R, in], lora_b [S, out, R], indices [T] -> delta [T, out]
    (float32). Gathers each token's A and B: the oracle, not the fast path."""
    safe = indices.clamp(min=0)
    shrink = torch.einsum("ti,tri->tr", x.float(), lora_a[safe].float())  # [T, R]
    delta = torch.einsum("tr,tor->to", shrink, lora_b[safe].float())  # [T, out]
    return delta * (indices >= 0).unsqueeze(1)


def add_lora_grouped(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """One pair of matmuls per adapter present in the batch (the CPU path; syncs)."""
    for slot in indices.unique().tolist():  # sync: the adapters present
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        delta = (x.index_select(0, rows) @ lora_a[slot].t()) @ lora_b[slot].t()
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


def add_lora_masked(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Every slot over every token, masked: no host sync and fixed shapes (graph-safe), at
    S times the work; the GPU fallback without Triton."""
    for slot in range(lora_a.shape[0]):
        mask = (indices == slot).to(x.dtype).unsqueeze(1)  # [T, 1]
        out += ((x @ lora_a[slot].t()) * mask) @ lora_b[slot].t()
    return out


SGMV_MIN_ROWS_PER_RUN = 8.0
"""Rows of one adapter in a row (on average) from which the tiled SGMV kernels beat per-row
BGMV: below it most row blocks mix adapters and loop over them."""


def use_sgmv(rows_per_run: float) -> bool:
    """SGMV for rows in long runs of one adapter, BGMV otherwise and always while a CUDA graph
    is being captured (decode graphs: one row per request; the graph replays whatever kernel it
    captured, reading the indices in place, so the choice is only about speed)."""
    if rows_per_run < SGMV_MIN_ROWS_PER_RUN:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    *,
    rows_per_run: float = 1.0,
    sub_sizes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """out [T, out] += each token's adapter product (in place where possible; returns out).
    `rows_per_run`: the mean length of the runs of one slot in `indices` (1: every row its own,
    picks BGMV on CUDA); `sub_sizes`: a fused layer's sub-projection output sizes, whose B is
    block diagonal (`layers.LoRALinear`), so SGMV's expand skips the zero blocks."""
    shape = out.shape
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, shape[-1])
    if x2.is_cuda:
        from v1.lora.triton_ops import HAS_TRITON, bgmv_add_lora, sgmv_add_lora

        same_dtype = x2.dtype == lora_a.dtype == lora_b.dtype  # tl.dot's operands
        if HAS_TRITON and same_dtype and use_sgmv(rows_per_run):
            return sgmv_add_lora(
                out2, x2, lora_a, lora_b, indices, sub_sizes, rows_per_run
            ).reshape(shape)
        if HAS_TRITON:
            return bgmv_add_lora(out2, x2, lora_a, lora_b, indices).reshape(shape)
        return add_lora_masked(out2, x2, lora_a, lora_b, indices).reshape(shape)
    return add_lora_grouped(out2, x2, lora_a, lora_b, indices).reshape(shape)
