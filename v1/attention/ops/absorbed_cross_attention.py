"""Absorbed cross-attention: every decoder layer attends over the one cached encoder output E,
with W_k and W_v moved onto the query and the context (exact algebra, see
`absorbed_cross_attention`). Owns the projections, the encoder-states cache writes and index,
and the torch path, which is the reference of the CUDA and Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from v1.quantization.fp8_rows import quantize_rows


@dataclass
class CrossProjection:
    """One layer's K/V projection of the encoder output, as the absorbed path reads it: the
    fused [W_k; W_v] weight [2 * Hkv * D, d] (fp8 with per-row scales when quantized) and the
    bias (b_k is never read: it cancels in softmax)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    bias: torch.Tensor | None
    head_size: int

    @classmethod
    def of(cls, kv_proj: Any, head_size: int) -> CrossProjection:
        """From a fused k/v `Linear` (with `weight_scale` when fp8-quantized): its
        `absorbed_weight` when the runner dequantized it for the absorbed mode
        (`dequantize_for_absorbed`), else its weight and scales."""
        absorbed = getattr(kv_proj, "absorbed_weight", None)
        if absorbed is not None:
            return cls(absorbed, None, kv_proj.bias, head_size)
        scale = getattr(kv_proj, "weight_scale", None)
        return cls(kv_proj.weight, scale, kv_proj.bias, head_size)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.weight.shape[0] // 2
        return self.weight[:rows], self.weight[rows:]


def dequantize_for_absorbed(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """Give every fp8 cross-attention K/V projection of `model` an `absorbed_weight` in `dtype`
    (None removes them); returns how many. Absorbed cross-attention never runs the big GEMM
    over encoder positions that fp8 speeds up: it multiplies each step's queries and contexts
    by per-head W_k and W_v, which from fp8 meant converting both to the model dtype in every
    layer of every step (whisper-large-v3, 256 clips, H100: fp8 weights gained 2% end to end
    against 13% for turbo, whose decoder has 4 layers instead of 32)."""
    from v1.quantization.fp8 import is_fp8_linear
    from v1.quantization.fp8_rows import dequantize_rows

    count = 0
    for module in model.modules():
        kv_proj = getattr(module, "kv_proj", None)
        if kv_proj is None or not is_fp8_linear(kv_proj):
            continue
        if dtype is None:
            kv_proj.absorbed_weight = None
        else:
            kv_proj.absorbed_weight = dequantize_rows(kv_proj.weight, kv_proj.weight_scale, dtype)
            count += 1
    return count


def _per_head(weight: torch.Tensor, num_heads: int, head_size: int) -> torch.Tensor:
    """[Hkv * D, d] -> [H, D, d], repeating each kv head's rows for its query heads."""
    num_kv_heads = weight.shape[0] // head_size
    w = weight.view(num_kv_heads, head_size, weight.shape[1])
    if num_kv_heads != num_heads:
        w = w.repeat_interleave(num_heads // num_kv_heads, dim=0)
    return w


def _scale_per_head(scale: torch.Tensor, num_heads: int, head_size: int) -> torch.Tensor:
    """[Hkv * D] -> [H, D] (the per-output-channel scales of an fp8 weight)."""
    s = scale.view(-1, head_size)
    if s.shape[0] != num_heads:
        s = s.repeat_interleave(num_heads // s.shape[0], dim=0)
    return s


def absorb_query(
    query: torch.Tensor, proj: CrossProjection, num_heads: int, scale: float
) -> torch.Tensor:
    """q [T, H * D] -> q' = scale * q_h W_k,h^T per head, [T, H, d] (in q's dtype). The scale
    is the batched GEMM's alpha (applied to its float32 products: no pass over q to scale and
    cast it, three small kernels a layer call before); an fp8 weight's per-row scales fold into
    q (they scale W_k's rows, which q_h contracts over)."""
    num_tokens, head_size = query.shape[0], proj.head_size
    w_k, _ = proj.halves()
    q = query.view(num_tokens, num_heads, head_size)
    alpha = scale
    if proj.weight_scale is not None:
        k_scale, _ = proj.weight_scale.chunk(2)
        q = (q.float() * scale * _scale_per_head(k_scale, num_heads, head_size)).to(query.dtype)
        alpha = 1.0
    w = _per_head(w_k, num_heads, head_size).to(query.dtype)  # [H, D, d]
    unused = q.new_empty(())  # baddbmm's input, ignored at beta = 0
    return torch.baddbmm(unused, q.transpose(0, 1), w, beta=0, alpha=alpha).transpose(0, 1)


def project_values(context: torch.Tensor, proj: CrossProjection) -> torch.Tensor:
    """context [T, H, d] (attention over E) -> out_h = context_h W_v,h^T + b_v,h, [T, H * D].
    Exact because every row of softmax weights sums to one."""
    num_tokens, num_heads, _ = context.shape
    head_size = proj.head_size
    _, w_v = proj.halves()
    bias = None if proj.bias is None else proj.bias.chunk(2)[1]
    w = _per_head(w_v, num_heads, head_size).to(context.dtype)  # [H, D, d]
    out = torch.bmm(context.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)  # [T, H, D]
    if proj.weight_scale is not None:
        _, v_scale = proj.weight_scale.chunk(2)
        out = (out.float() * _scale_per_head(v_scale, num_heads, head_size)).to(context.dtype)
    if bias is not None:
        b = bias.view(-1, head_size)
        if b.shape[0] != num_heads:
            b = b.repeat_interleave(num_heads // b.shape[0], dim=0)
        out = out + b.to(out.dtype)
    return out.reshape(num_tokens, num_heads * head_size)


# ---- the encoder-states cache ----


def states_index(
    slots: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat slots (block_id * block_size + offset) -> (tensor, half, block, row) indices into
    `states` [span, 2, num_blocks, rows_per_half, d].

    A pool block of an attention layer is two halves (K and V) of rows in each of the pool's
    tensors; encoder states use both halves of the block's page in `span` tensors,
    `rows_per_half` encoder positions each (fp8 adds `scales` [span, 2, num_blocks,
    rows_per_half]). Position p of a request lives in block table entry p // block_size at
    offset o = p % block_size: tensor o // page_rows, then within it half
    (o % page_rows) // rows_per_half, row o % rows_per_half (page_rows = 2 * rows_per_half,
    block_size = span * page_rows)."""
    span, rows_per_half = states.shape[0], states.shape[3]
    page_rows = 2 * rows_per_half
    block, offset = slots // (span * page_rows), slots % (span * page_rows)
    in_page = offset % page_rows
    return offset // page_rows, in_page // rows_per_half, block, in_page % rows_per_half


def states_block_size(states: torch.Tensor) -> int:
    """Encoder positions per block id of `states` [span, 2, num_blocks, rows_per_half, d]."""
    return states.shape[0] * 2 * states.shape[3]


def write_encoder_states(
    rows: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Encoder output rows [N, d] -> the cache at flat slots (-1 skips a row); fp8 caches
    (`scales` given) store each row quantized with its own scale.

    No host sync: a skipped row is written to slot 0 instead, which belongs to the block pool's
    null block (never handed out, never read unmasked), rather than selected out by a boolean
    mask (whose size the host would have to wait for)."""
    index = states_index(slot_mapping.clamp(min=0), states)
    values = rows[: slot_mapping.shape[0]]
    if scales is None:
        states[index] = values.to(states.dtype)
        return
    q, s = quantize_rows(values)
    states[index] = q
    scales[index] = s


def attend_encoder_states_torch(
    q_abs: torch.Tensor,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    metadata: Any,
) -> torch.Tensor:
    """The reference: q' [T, H, d] (scale folded in) attends over each request's encoder states
    -> context [T, H, d]. The torch SDPA backend's metadata (built with the encoder-states
    block size; from any other backend's `common` here) gives every request's rows of E as
    padded key slots; the heads of a query token attend as separate query rows over the one E
    (multi-query attention of width d)."""
    from v1.attention.backend import AttentionType
    from v1.attention.backends.torch_sdpa import SDPAMetadata, SDPAMetadataBuilder

    if not isinstance(metadata, SDPAMetadata):
        builder = SDPAMetadataBuilder(
            AttentionType.ENCODER_DECODER, q_abs.device, states_block_size(states)
        )
        metadata = builder.build(metadata.common)
    md, common = metadata, metadata.common
    num_heads, dim = q_abs.shape[1], q_abs.shape[2]
    num_tokens = common.num_actual_tokens
    num_reqs = common.num_reqs
    max_q = md.mask.shape[2]
    index = states_index(md.key_gather, states)
    keys = states[index]  # [R, max_k, d]
    if scales is not None:
        keys = keys.float() * scales[index][..., None]
    keys = keys.to(q_abs.dtype)[:, None]  # [R, 1, max_k, d]
    q = q_abs.new_zeros(num_reqs, max_q, num_heads, dim)
    q[md.token_req, md.token_local] = q_abs[:num_tokens]
    q = q.reshape(num_reqs, 1, max_q * num_heads, dim)  # row j * H + h: token j, head h
    mask = md.mask.repeat_interleave(num_heads, dim=2)  # [R, 1, max_q * H, max_k]
    out = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask, scale=1.0)
    out = out.reshape(num_reqs, max_q, num_heads, dim)[md.token_req, md.token_local]
    if q_abs.shape[0] > num_tokens:  # padded batch: pad rows come back as zeros
        out = torch.cat([out, out.new_zeros(q_abs.shape[0] - num_tokens, num_heads, dim)])
    return out  # [T, H, d]


def absorbed_cross_attention(
    query: torch.Tensor,
    proj: CrossProjection,
    states: torch.Tensor,
    scales: torch.Tensor | None,
    metadata: Any,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """One layer's cross-attention over the cached encoder states: query [T, H * D] ->
    [T, H * D] (the input of the layer's output projection).

    Per head h, with E [S, d] a request's encoder output (exact algebra):
        scores_h = q_h (E W_k,h + b_k,h)^T = (q_h W_k,h^T) E^T + const   (const cancels in softmax)
        out_h    = softmax(scores_h) (E W_v,h + b_v,h) = (softmax(scores_h) E) W_v,h + b_v,h
    So the query is projected into model space (`absorb_query`: q' = q W_k^T, [T, H, d]),
    attends over the paged E (`attend_encoder_states_*`: the torch reference here, a CUDA
    kernel in `cuda_absorbed.py` for 16-bit models, a Triton kernel in `triton_absorbed.py`
    for the rest), and W_v and b_v apply to the [T, H, d] context (`project_values`)."""
    q_abs = absorb_query(query, proj, num_heads, scale)  # [T, H, d]
    if q_abs.is_cuda and hasattr(metadata, "work"):  # the Triton backend's work items
        context = attend_encoder_states_gpu(q_abs, states, scales, metadata)
    else:
        context = attend_encoder_states_torch(q_abs, states, scales, metadata)
    return project_values(context, proj)


def attend_encoder_states_gpu(
    q_abs: torch.Tensor, states: torch.Tensor, scales: torch.Tensor | None, metadata: Any
) -> torch.Tensor:
    """The CUDA kernel where it takes the inputs (a 16-bit model, int32 metadata), else the
    Triton kernel."""
    from v1.attention.ops.cuda_absorbed import attend_encoder_states_cuda, kernel_for
    from v1.attention.ops.triton_absorbed import attend_encoder_states_triton

    built = kernel_for(q_abs, states, scales)
    common = metadata.common
    indices = (common.query_start_loc, common.seq_lens, common.block_table, *metadata.work)
    if built is not None and all(t.dtype == torch.int32 for t in indices):
        return attend_encoder_states_cuda(q_abs, states, scales, metadata, *built)
    return attend_encoder_states_triton(q_abs, states, scales, metadata)
