"""Triton multi-LoRA kernels; the plain-torch oracle is `ops.lora_delta_reference`. Tokens of the
base model (slot -1) add nothing. Both forms are index-driven and sync-free (CUDA graphs replay
them reading the indices tensor in place); they differ in shape, and `ops.add_lora` picks one
per call.

- BGMV (batched gather matrix-vector, after Punica): one program per row, each reading its own
  slot's A and B. `shrink`: y[t] = A[s_t] x[t] ([R]); `expand`: out[t] += B[s_t] y[t]. Right for
  decode rows (one per request, adapters interleaved).
- SGMV (segmented gather matrix-matrix, after Punica/S-LoRA SGMV and vLLM's lora_shrink /
  lora_expand): tiled `tl.dot` over (row block, output block). A row block whose rows share one
  slot (the encoder's 1500 rows per request, prefill chunks) is one matmul against that slot's
  A (or B); a block whose rows mix slots loops over its distinct slots, each a matmul of the
  block with the other rows masked, so any slot pattern is exact. The expand launches once for
  all sub-projections of a fused layer and uses only each one's own rank columns (B is block
  diagonal, see `layers.LoRALinear`).
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


if HAS_TRITON:

    @triton.jit
    def _shrink_slot_rows(
        x_ptr,
        a_ptr,
        y_ptr,
        rows64,
        sel,
        slot,
        K,
        R,
        stride_xt,
        stride_xk,
        stride_as,
        stride_ar,
        stride_ak,
        stride_yt,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y[rows where sel] = x[those rows] A[slot]^T (fp32)."""
        r = tl.arange(0, BLOCK_R)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        a_base = a_ptr + slot.to(tl.int64) * stride_as + r[None, :] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            xt = tl.load(
                x_ptr + rows64[:, None] * stride_xt + k[None, :] * stride_xk,
                mask=sel[:, None] & (k[None, :] < K),
                other=0.0,
            )
            at = tl.load(
                a_base + k[:, None] * stride_ak,
                mask=(k[:, None] < K) & (r[None, :] < R),
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]: A[slot]^T
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)
        tl.store(
            y_ptr + rows64[:, None] * stride_yt + r[None, :],
            acc,
            mask=sel[:, None] & (r[None, :] < R),
        )

    @triton.jit
    def _sgmv_shrink_kernel(
        x_ptr,
        a_ptr,
        y_ptr,
        idx_ptr,
        T,
        K,
        R,
        num_slots,
        stride_xt,
        stride_xk,
        stride_as,
        stride_ar,
        stride_ak,
        stride_yt,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y[rows] = x[rows] A[slot]^T for one block of rows, fp32 (rows of slot -1: unwritten).
        A block of one slot (besides -1 rows) takes the straight path, whose K loop Triton
        pipelines; a mixed block loops over its distinct slots."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(idx_ptr + rows, mask=rows < T, other=-1)
        rows64 = rows.to(tl.int64)
        lo = tl.min(tl.where(slots >= 0, slots, num_slots), axis=0)
        hi = tl.max(slots, axis=0)
        if lo == hi:
            _shrink_slot_rows(
                x_ptr, a_ptr, y_ptr, rows64, slots == lo, lo, K, R,
                stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_yt,
                BLOCK_M, BLOCK_R, BLOCK_K, PRECISION,
            )  # fmt: skip
        elif lo < num_slots:
            # The block's distinct slots in increasing order (num_slots: none left).
            cur = lo
            while cur < num_slots:
                _shrink_slot_rows(
                    x_ptr, a_ptr, y_ptr, rows64, slots == cur, cur, K, R,
                    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_yt,
                    BLOCK_M, BLOCK_R, BLOCK_K, PRECISION,
                )  # fmt: skip
                cur = tl.min(tl.where(slots > cur, slots, num_slots), axis=0)

    @triton.jit
    def _sgmv_expand_kernel(
        y_ptr,
        b_ptr,
        out_ptr,
        idx_ptr,
        offsets_ptr,
        T,
        SUB_R,
        num_slots,
        stride_yt,
        stride_bs,
        stride_bn,
        stride_br,
        stride_ot,
        stride_on,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """out[rows, cols] += y[rows, ranks of sub j] B[slot][cols, ranks of sub j]^T, where
        program_id(2) = j is the sub-projection whose output columns are
        [offsets[j], offsets[j+1]) and whose ranks are [j*SUB_R, (j+1)*SUB_R)."""
        sub = tl.program_id(2)
        n_lo = tl.load(offsets_ptr + sub)
        n_hi = tl.load(offsets_ptr + sub + 1)
        n0 = n_lo + tl.program_id(1) * BLOCK_N
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(idx_ptr + rows, mask=rows < T, other=-1)
        cur = tl.min(tl.where(slots >= 0, slots, num_slots), axis=0)
        if (n0 < n_hi) & (cur < num_slots):
            rows64 = rows.to(tl.int64)
            n = n0 + tl.arange(0, BLOCK_N)
            rr = tl.arange(0, BLOCK_R)
            ranks = sub * SUB_R + rr
            y = tl.load(
                y_ptr + rows64[:, None] * stride_yt + ranks[None, :],
                mask=(slots[:, None] >= 0) & (rr[None, :] < SUB_R),
                other=0.0,
            )  # [BLOCK_M, BLOCK_R] fp32
            delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            while cur < num_slots:
                b = tl.load(
                    b_ptr
                    + cur.to(tl.int64) * stride_bs
                    + n[None, :] * stride_bn
                    + ranks[:, None] * stride_br,
                    mask=(rr[:, None] < SUB_R) & (n[None, :] < n_hi),
                    other=0.0,
                )  # [BLOCK_R, BLOCK_N]: B[slot]^T
                ys = tl.where((slots == cur)[:, None], y, 0.0).to(b.dtype)
                delta = tl.dot(ys, b, delta, input_precision=PRECISION)
                cur = tl.min(tl.where(slots > cur, slots, num_slots), axis=0)
            ptrs = out_ptr + rows64[:, None] * stride_ot + n[None, :] * stride_on
            mask = (slots[:, None] >= 0) & (n[None, :] < n_hi)
            old = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


_OFFSETS: dict[tuple, torch.Tensor] = {}
"""Device copies of fused layers' output offsets, made once per (sizes, device)."""


def _output_offsets(sub_sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (sub_sizes, str(device))
    offsets = _OFFSETS.get(key)
    if offsets is None:
        values = [0]
        for size in sub_sizes:
            values.append(values[-1] + size)
        offsets = _OFFSETS[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return offsets


def sgmv_blocks(num_tokens: int, rows_per_run: float) -> tuple[int, int]:
    """(BLOCK_M of the shrink, BLOCK_M of the expand) for a call: large blocks where runs of one
    slot are long (the encoder), small ones where they are short (few mixed blocks)."""
    if num_tokens < 256 or rows_per_run < 32:
        return 16, 16
    if num_tokens < 8192 or rows_per_run < 256:
        return 64, 64
    return 128, 64


def sgmv_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    sub_sizes: tuple[int, ...] | None = None,
    rows_per_run: float = 1e9,
    *,
    block_m: int | None = None,
    block_k: int = 64,
    block_n: int = 128,
    block_m_expand: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """out [T, N] += B[s_t] A[s_t] x[t] for x [T, K], lora_a [S, R, K], lora_b [S, N, R],
    indices [T] (int64, -1: none), in place on out. `sub_sizes`: the output sizes of a fused
    layer's sub-projections (they sum to N); sub-projection j owns ranks [j*R/n, (j+1)*R/n) and
    B is zero elsewhere, so the expand uses only those (None: one projection, all R ranks).
    `rows_per_run` (mean rows of one slot in a row) only picks block sizes; keyword block sizes
    override them (the micro-benchmark's sweep)."""
    num_tokens = x.shape[0]
    rank, n = lora_a.shape[1], lora_b.shape[1]
    if num_tokens == 0:
        return out
    sub_sizes = sub_sizes or (n,)
    assert sum(sub_sizes) == n and rank % len(sub_sizes) == 0, (sub_sizes, n, rank)
    assert indices.shape[0] >= num_tokens
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    auto_m, auto_m_expand = sgmv_blocks(num_tokens, rows_per_run)
    block_m, block_m_expand = block_m or auto_m, block_m_expand or auto_m_expand
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = (precision, num_warps, num_stages)
    y = _shrink(x, lora_a, indices, block_m, block_k, launch)
    _expand(y, lora_b, out, indices, tuple(sub_sizes), block_m_expand, block_n, launch)
    return out


def _shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    indices: torch.Tensor,
    block_m: int,
    block_k: int,
    launch: tuple[str, int, int],
) -> torch.Tensor:
    """y [T, R] (float32) = A[s_t] x[t]: the shrink kernel. `launch` = (dot precision, warps,
    stages)."""
    num_tokens, k = x.shape
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    precision, num_warps, num_stages = launch
    y = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    _sgmv_shrink_kernel[(triton.cdiv(num_tokens, block_m),)](
        x,
        lora_a,
        y,
        indices,
        num_tokens,
        k,
        rank,
        num_slots,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=max(triton.next_power_of_2(rank), 16),
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def _expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    sub_sizes: tuple[int, ...],
    block_m: int,
    block_n: int,
    launch: tuple[str, int, int],
) -> None:
    """out[t, sub-projection j] += B[s_t][j] y[t, ranks of j]: the expand kernel."""
    num_tokens, rank = y.shape
    num_slots = lora_b.shape[0]
    precision, num_warps, num_stages = launch
    sub_rank = rank // len(sub_sizes)
    grid = (
        triton.cdiv(num_tokens, block_m),
        triton.cdiv(max(sub_sizes), block_n),
        len(sub_sizes),
    )
    _sgmv_expand_kernel[grid](
        y,
        lora_b,
        out,
        indices,
        _output_offsets(sub_sizes, y.device),
        num_tokens,
        sub_rank,
        num_slots,
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(triton.next_power_of_2(sub_rank), 16),
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
