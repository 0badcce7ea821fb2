"""The batched LoRA product of one Linear: out[t] += B[s] (A[s] x[t]) for each token t with
adapter slot s = indices[t] (-1: the base model, nothing added). `lora_delta_reference` is the
plain-torch oracle; `add_lora` picks grouped matmuls per adapter on CPU, the Triton BGMV
kernels on CUDA, or (no Triton) a per-slot masked form that never syncs (CUDA graphs).
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


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """out [T, out] += each token's adapter product (in place where possible; returns out)."""
    shape = out.shape
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, shape[-1])
    if x2.is_cuda:
        from v1.lora.triton_ops import HAS_TRITON, bgmv_add_lora

        if HAS_TRITON:
            return bgmv_add_lora(out2, x2, lora_a, lora_b, indices).reshape(shape)
        return add_lora_masked(out2, x2, lora_a, lora_b, indices).reshape(shape)
    return add_lora_grouped(out2, x2, lora_a, lora_b, indices).reshape(shape)
