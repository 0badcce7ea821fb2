"""Triton backend (GPU): one paged varlen kernel for all four attention types, bias in-kernel."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from v1 import envs
from v1.attention.backend import (
    AttentionBackend,
    AttentionBias,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    CommonAttentionMetadata,
    MaterializedBias,
    RelativePositionBias,
    power_of_two_parts,
)
from v1.attention.ops import encoder_tiles, fa4, triton_encoder_attention
from v1.attention.ops import triton_attention as ops
from v1.logger import init_logger

logger = init_logger(__name__)

BLOCK_M = 64
DECODE_BLOCK_M = 16
_CUDNN_OK = [True]
"""Cleared when cuDNN attention refuses a shape: equal-length batches fall back to varlen."""
_CUDNN_VARLEN_OK = [True]
"""Cleared when cuDNN's ragged attention refuses (or returns an unexpected shape): packed
batches go to flash varlen from then on (`V1_CUDNN_VARLEN`)."""


def _load_varlen_attn() -> tuple[object | None, bool]:
    """torch's fused varlen (flash) attention, when this torch has it: (fn, takes_scale)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "scale" in inspect.signature(varlen_attn).parameters


_VARLEN_ATTN, _VARLEN_TAKES_SCALE = _load_varlen_attn()


def _load_flash_forward() -> Any:
    """aten's flash varlen forward (what varlen_attn calls), when its schema is the one used
    here (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale); None: go through varlen_attn."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return None
    names = [a.name for a in op.default._schema.arguments]
    expected = ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k"]
    if names[:7] != expected or "scale" not in names:
        return None
    return op


_FLASH_FORWARD = _load_flash_forward()


def _cudnn_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int, scale: float
) -> torch.Tensor | None:
    """Packed rows [batch * length, H, D] of equal-length sequences through cuDNN's dense
    fused attention -> [batch * length, H, D]; None (and flash varlen from then on) where
    cuDNN refuses the shape, dtype or build."""

    def dense(x: torch.Tensor) -> torch.Tensor:  # [B * L, H, D] -> [B, H, L, D] (a view)
        return x.unflatten(0, (batch, length)).transpose(1, 2)

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(dense(q), dense(k), dense(v), scale=scale)
    except RuntimeError as e:
        logger.info("cuDNN attention unavailable (%s); using flash varlen", e)
        _CUDNN_OK[0] = False
        return None
    return out.transpose(1, 2).reshape(batch * length, *q.shape[1:])


@dataclass
class TritonMetadata:
    common: CommonAttentionMetadata
    work: tuple[torch.Tensor, torch.Tensor]
    """(request, query block) per program."""
    block_m: int
    uniform_query_len: int | None = None
    """Every request's query length when all are equal (Whisper's 1500-frame windows)."""
    encoder_tiles: dict[int, torch.Tensor] = field(default_factory=dict)
    """Tile rows -> the encoder-only kernel's tile table, made on the device by a step's first
    layer and read by the rest (`encoder_tiles.query_tiles`)."""


class TritonMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        block_m = DECODE_BLOCK_M if common.max_query_len <= DECODE_BLOCK_M else BLOCK_M
        offsets = common.query_start_loc_cpu[: common.num_reqs + 1]
        work = ops.make_work_items(offsets, block_m, self.device)
        lens = np.diff(offsets.numpy())
        uniform = int(lens[0]) if len(lens) and (lens == lens[0]).all() else None
        return TritonMetadata(common, work, block_m, uniform)

    def graph_work(self, metadata: TritonMetadata) -> tuple[int, int]:
        return metadata.work[0].numel(), metadata.block_m


class TritonImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
        bias: AttentionBias | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        common = attn_metadata.common
        paged = self.attn_type.has_kv_cache
        if not paged and bias is None and self._can_use_varlen(query):
            if self._encoder_only_kernel(common):
                return self._encoder_only_forward(query, key, value, attn_metadata)
            if not common.causal and attn_metadata.uniform_query_len and _CUDNN_OK[0]:
                out = self._uniform_forward(query, key, value, common, attn_metadata)
                if out is not None:
                    return out
            return self._varlen_forward(query, key, value, common)
        if paged and key is not None and common.slot_mapping is not None:
            ops.write_kv_cache(key, value, kv_cache, common.slot_mapping, kv_scales)
        scales = None
        if paged:
            k = kv_cache[0].flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
            v = kv_cache[1].flatten(0, 1)
            page = kv_cache.shape[2]
            if kv_scales is not None:  # [num_blocks * block_size, Hkv] each
                scales = (kv_scales[0].flatten(0, 1), kv_scales[1].flatten(0, 1))
        else:
            k, v, page = key, value, 1
        out = torch.empty_like(query)
        bias_tensor, bias_mode, relative = None, ops.BIAS_NONE, (32, 128, True)
        if isinstance(bias, MaterializedBias):
            bias_tensor, bias_mode = bias.bias, ops.BIAS_MATERIALIZED
        elif isinstance(bias, RelativePositionBias):
            bias_tensor, bias_mode = bias.table, ops.BIAS_RELATIVE
            relative = (bias.num_buckets, bias.max_distance, bias.bidirectional)
        return ops.paged_attention(
            query,
            k,
            v,
            out,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            work=attn_metadata.work,
            query_positions=common.query_positions,
            scale=self.scale,
            causal=common.causal,
            block_table=common.block_table if paged else None,
            page_size=page,
            bias=bias_tensor,
            bias_mode=bias_mode,
            relative=relative,
            block_m=attn_metadata.block_m,
            kv_scales=scales,
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        ops.write_kv_cache(key, value, kv_cache, attn_metadata.common.slot_mapping, kv_scales)

    def _can_use_varlen(self, query: torch.Tensor) -> bool:
        """Cache-less types without bias go to torch's flash varlen kernel (16-bit, MHA)."""
        return (
            _VARLEN_ATTN is not None
            and query.dtype in (torch.float16, torch.bfloat16)
            and self.num_heads == self.num_kv_heads
            and self.head_size % 8 == 0
            and self.head_size <= 256
        )

    def _encoder_only_kernel(self, common: CommonAttentionMetadata) -> bool:
        return (
            envs.V1_TRITON_ENCODER_ONLY
            and not envs.V1_CUDNN_VARLEN  # the opt-in experiment keeps its kernel
            and self.attn_type == AttentionType.ENCODER_ONLY
            and not common.causal
            and triton_encoder_attention.supports(self.head_size, common.max_query_len)
        )

    def _encoder_only_forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: TritonMetadata
    ) -> torch.Tensor:
        """Packed bidirectional rows through the Triton encoder-only kernel; the step's tile
        table is made at its first layer."""
        common = metadata.common
        rows = common.num_actual_tokens
        cu_seq = common.query_start_loc[: common.num_reqs + 1]
        block_m = triton_encoder_attention.tile_rows(self.head_size)
        tiles = metadata.encoder_tiles.get(block_m)
        if tiles is None:
            tiles = encoder_tiles.query_tiles(cu_seq, rows, block_m)
            metadata.encoder_tiles[block_m] = tiles
        out = triton_encoder_attention.encoder_attention(
            query[:rows], key[:rows], value[:rows], cu_seq, self.scale, tiles
        )
        return self._pad_rows(out, query.shape[0])

    def _uniform_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        common: CommonAttentionMetadata,
        metadata: TritonMetadata,
    ) -> torch.Tensor | None:
        """Equal-length bidirectional sequences as dense batches: FlashAttention-4 where it is
        installed and the batch holds 8+ sequences (`fa4.dense_attention`), else cuDNN's fused
        attention: on an H100, 32 Whisper windows (1500 positions, 20 heads of 64) took 956 us
        against 1,353 us in flash varlen. cuDNN runs the batch in power-of-two parts (25
        windows: 16, 8, 1), so a process builds at most log2(max batch) + 1 cuDNN plans: each
        new batch size costs a plan build of ~67 ms (H200), and encoder steps come in every
        size from 1 to the step budget. None when cuDNN refuses (varlen runs instead)."""
        length = metadata.uniform_query_len
        assert length is not None
        num_reqs = common.num_reqs
        num_tokens = num_reqs * length
        if num_tokens != common.num_actual_tokens:
            return None
        rows = slice(0, num_tokens)
        out = fa4.dense_attention(query[rows], key[rows], value[rows], num_reqs, length, self.scale)
        if out is not None:
            return self._pad_rows(out, query.shape[0])
        parts = []
        first = 0
        for size in power_of_two_parts(num_reqs):
            rows = slice(first * length, (first + size) * length)
            first += size
            out = _cudnn_dense(query[rows], key[rows], value[rows], size, length, self.scale)
            if out is None:
                return None
            parts.append(out)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._pad_rows(out, query.shape[0])

    @staticmethod
    def _pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
        """A padded batch's output: its pad rows are zeros."""
        if rows > out.shape[0]:
            out = torch.cat([out, out.new_zeros(rows - out.shape[0], *out.shape[1:])])
        return out

    def _varlen_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        common: CommonAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = common.num_actual_tokens
        cu_seq = common.query_start_loc[: common.num_reqs + 1]
        q = query[:num_tokens]
        if not common.causal and envs.V1_CUDNN_VARLEN and _CUDNN_VARLEN_OK[0]:
            out = self._cudnn_varlen_forward(q, key[:num_tokens], value[:num_tokens], common)
            if out is not None:
                return self._pad_rows(out, query.shape[0])
        kwargs = {}
        if _FLASH_FORWARD is not None:
            # The aten op varlen_attn wraps, called directly: 20 us of host time per call
            # against 56 us through the custom-op wrapper (H100 host, BERT-base shapes).
            out = _FLASH_FORWARD(
                q,
                key[:num_tokens],
                value[:num_tokens],
                cu_seq,
                cu_seq,
                common.max_query_len,
                common.max_query_len,
                0.0,
                common.causal,
                False,
                scale=self.scale,
            )[0]
            return self._pad_rows(out, query.shape[0])
        if _VARLEN_TAKES_SCALE:
            kwargs["scale"] = self.scale
        else:  # older torch: fold the scale into q (flash uses 1/sqrt(D))
            q = q * (self.scale * math.sqrt(self.head_size))
        out = _VARLEN_ATTN(
            q,
            key[:num_tokens],
            value[:num_tokens],
            cu_seq,
            cu_seq,
            common.max_query_len,
            common.max_query_len,
            **kwargs,
        )
        return self._pad_rows(out, query.shape[0])

    def _cudnn_varlen_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        common: CommonAttentionMetadata,
    ) -> torch.Tensor | None:
        """Packed sequences [T, H, D] (rows may be strided) through cuDNN's ragged fused
        attention (aten's `_cudnn_attention_forward` with cumulative offsets, what nested-tensor
        SDPA calls). None, and flash varlen from then on, where cuDNN refuses."""
        cu_seq = common.query_start_loc[: common.num_reqs + 1]
        try:
            out = torch.ops.aten._cudnn_attention_forward(
                q,
                k,
                v,
                None,
                cu_seq,
                cu_seq,
                common.max_query_len,
                common.max_query_len,
                False,
                0.0,
                False,
                False,
                scale=self.scale,
            )[0]
        except Exception as e:  # noqa: BLE001 - any refusal (or another torch's schema): flash
            logger.info("cuDNN ragged attention unavailable (%s); using flash varlen", e)
            _CUDNN_VARLEN_OK[0] = False
            return None
        if out.shape != q.shape:
            logger.info(
                "cuDNN ragged attention returned %s for %s; using flash varlen",
                tuple(out.shape),
                tuple(q.shape),
            )
            _CUDNN_VARLEN_OK[0] = False
            return None
        return out


class TritonBackend(AttentionBackend):
    name = "triton"
    capabilities = BackendCapabilities(
        materialized_bias=True,
        in_kernel_bias=True,
        fp8_kv_cache=True,
        fp8_min_compute_capability=(8, 9),  # Triton's float8e4nv
        device_types=frozenset({"cuda"}),
        decode_cuda_graphs=True,
        graph_max_query_len=DECODE_BLOCK_M,
        encoder_cuda_graphs=True,
        required_packages=("triton",),
    )

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonImpl
