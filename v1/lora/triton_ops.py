"""Triton BGMV (batched gather matrix-vector, after Punica): each token reads its own adapter
slot's A and B. `shrink`: y[t] = A[s_t] x[t] ([R]); `expand`: out[t] += B[s_t] y[t]. Tokens of
the base model (slot -1) add nothing. The plain-torch oracle is `ops.lora_delta_reference`.
Index-driven and sync-free, so CUDA graphs replay it reading the indices tensor in place.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        y_ptr,
        idx_ptr,
        K,
        R,
        stride_xt,
        stride_as,
        stride_ar,
        stride_yt,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(idx_ptr + t)
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if slot >= 0:
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
                a = tl.load(
                    a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < K),
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(a * xv[None, :], axis=1)
        tl.store(y_ptr + t * stride_yt + r, acc, mask=r < R)

    @triton.jit
    def _expand_kernel(
        y_ptr,
        b_ptr,
        out_ptr,
        idx_ptr,
        N,
        R,
        stride_yt,
        stride_bs,
        stride_bn,
        stride_ot,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_ptr + t)
        if slot >= 0:
            r = tl.arange(0, BLOCK_R)
            y = tl.load(y_ptr + t * stride_yt + r, mask=r < R, other=0.0)
            b = tl.load(
                b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R),
                other=0.0,
            ).to(tl.float32)
            delta = tl.sum(b * y[None, :], axis=1)
            ptrs = out_ptr + t * stride_ot + n
            old = tl.load(ptrs, mask=n < N, other=0.0)
            tl.store(ptrs, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=n < N)


def bgmv_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """out [T, N] += B[s_t] A[s_t] x[t] for x [T, K], lora_a [S, R, K], lora_b [S, N, R],
    indices [T] (int64, -1: none). In place on out (contiguous rows)."""
    num_tokens, k = x.shape
    rank, n = lora_a.shape[1], lora_b.shape[1]
    if num_tokens == 0:
        return out
    x = x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    assert out.stride(1) == 1 and indices.shape[0] >= num_tokens
    y = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = max(triton.next_power_of_2(rank), 16)
    _shrink_kernel[(num_tokens,)](
        x,
        lora_a,
        y,
        indices,
        k,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        y.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=128,
    )
    block_n = 128
    _expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        y,
        lora_b,
        out,
        indices,
        n,
        rank,
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return out
