"""CUDA-graph replays emulated on CPU, to test the graph manager's plumbing without a GPU.

`EmulatedBackend` mirrors the Triton backend's contract: the builder makes (request, query
block) work items from host offsets, and the impl reads every step value from the metadata's
tensors when it runs, program by program as the kernel does (rows no program stores stay NaN).
`EmulatedGraphs` "captures" by building each size's metadata once; a replay re-runs the
forward over the static buffers with that metadata, which is what a CUDA graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from v1.attention.backend import (
    AttentionBackend,
    AttentionBias,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendCapabilities,
    CommonAttentionMetadata,
)
from v1.attention.ops.reference import naive_attention, write_kv_cache
from v1.worker.cuda_graphs import CudaGraphManager

BLOCK_M, DECODE_BLOCK_M = 64, 16
"""The Triton backend's query blocks."""


@dataclass
class EmulatedMetadata:
    common: CommonAttentionMetadata
    work: tuple[torch.Tensor, torch.Tensor]
    block_m: int


class EmulatedBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> EmulatedMetadata:
        block_m = DECODE_BLOCK_M if common.max_query_len <= DECODE_BLOCK_M else BLOCK_M
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
        blocks = (qsl[1:] - qsl[:-1] + block_m - 1) // block_m
        req = torch.repeat_interleave(torch.arange(len(blocks)), blocks)
        starts = torch.cumsum(blocks, 0) - blocks
        mblock = torch.arange(int(blocks.sum())) - torch.repeat_interleave(starts, blocks)
        return EmulatedMetadata(common, (req, mblock), block_m)

    def graph_work(self, metadata: EmulatedMetadata) -> tuple[int, int]:
        return metadata.work[0].numel(), metadata.block_m


class EmulatedImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: EmulatedMetadata,
        bias: AttentionBias | None = None,
    ) -> torch.Tensor:
        if bias is not None:
            raise NotImplementedError("the emulation has no bias")
        common = attn_metadata.common
        paged = self.attn_type.has_kv_cache
        if paged and key is not None and common.slot_mapping is not None:
            write_kv_cache(key, value, kv_cache, common.slot_mapping)
        out = torch.full_like(query, float("nan"))  # like torch.empty_like: never read stale
        qsl, seq_lens = common.query_start_loc.tolist(), common.seq_lens.tolist()
        block_m = attn_metadata.block_m
        per_req: dict[int, torch.Tensor] = {}
        for req, mblock in zip(*(w.tolist() for w in attn_metadata.work), strict=True):
            q_start, q_len, kv_len = qsl[req], qsl[req + 1] - qsl[req], seq_lens[req]
            first, last = mblock * block_m, min(q_len, (mblock + 1) * block_m)
            if first >= last:
                continue
            rows = slice(q_start + first, q_start + last)
            if kv_len == 0:  # nothing to attend: the kernel stores zeros
                out[rows] = 0
                continue
            if req not in per_req:
                per_req[req] = self._attend(query, key, value, kv_cache, common, req)
            out[rows] = per_req[req][first:last]
        return out

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        common: CommonAttentionMetadata,
        req: int,
    ) -> torch.Tensor:
        """Request `req`'s whole query attended (the kernel's per-block math, all blocks)."""
        q_start = int(common.query_start_loc[req])
        q_len = int(common.query_start_loc[req + 1]) - q_start
        kv_len = int(common.seq_lens[req])
        if self.attn_type.has_kv_cache:
            page = kv_cache.shape[2]
            blocks = common.block_table[req, : -(-kv_len // page)].long()
            k = kv_cache[0, blocks].flatten(0, 1)[:kv_len]
            v = kv_cache[1, blocks].flatten(0, 1)[:kv_len]
        else:
            k, v = key[q_start : q_start + kv_len], value[q_start : q_start + kv_len]
        q = query[q_start : q_start + q_len]
        return naive_attention(q, k, v, self.scale, common.causal)


class EmulatedBackend(AttentionBackend):
    name = "graph_emulation"
    capabilities = BackendCapabilities(decode_cuda_graphs=True, graph_max_query_len=DECODE_BLOCK_M)

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return EmulatedBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return EmulatedImpl


class _EagerGraph:
    """Stands in for a torch.cuda.CUDAGraph: `replay` refills the static output."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.output = forward()

    def replay(self) -> None:
        self.output.copy_(self.forward())
        assert not self.output.isnan().any(), "a row of the padded step was never written"


class EmulatedGraphs(CudaGraphManager):
    def capture(self) -> None:
        for lens in self.seq_lens:
            lens.zero_()
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            graph = _EagerGraph(lambda size=size, metadata=metadata: self._forward(size, metadata))
            self.graphs[size] = (graph, graph.output, metadata)
