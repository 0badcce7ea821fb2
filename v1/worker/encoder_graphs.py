"""CUDA graphs of encoder-only passes (BERT, RoBERTa/XLM-R, cross-encoders): one graph per token
count (multiples of GRAPH_TOKEN_STEP) replays the whole model over static buffers, so big
varlen steps are not bound by kernel launches. Padding tokens form sequences of at most
`max_len` that attend among themselves only and are cut from the output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from v1 import envs
from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.forward_context import ForwardContext, set_forward_context
from v1.host_copy import to_device
from v1.logger import init_logger

logger = init_logger(__name__)

GRAPH_TOKEN_STEP = 1024
"""Graph sizes are multiples of this: at most 1023 padding tokens per step (~3% of a full
BERT step of 32K tokens)."""
MAX_GRAPHS = 64
"""Larger step budgets take coarser sizes (capture time grows with the number of graphs)."""
MAX_GRAPH_LEN = 2048
"""Longest input (position limit) a graphed model may take: the varlen kernel's grid is sized
for the fixed maximum length, so longer limits waste more empty programs."""


def graph_sizes(max_tokens: int) -> list[int]:
    """Multiples of GRAPH_TOKEN_STEP (of a multiple of it past MAX_GRAPHS graphs) covering
    `max_tokens`."""
    step = GRAPH_TOKEN_STEP * -(-max_tokens // (GRAPH_TOKEN_STEP * MAX_GRAPHS))
    return list(range(step, max_tokens + step, step))


def graph_offsets(
    query_start_loc: np.ndarray, size: int, num_slots: int, max_len: int
) -> np.ndarray:
    """[num_slots + 1] int32 varlen offsets: the step's requests, the padding up to `size` as
    sequences of at most `max_len` tokens, then empty sequences."""
    num_tokens = int(query_start_loc[-1])
    pad_ends = np.arange(num_tokens + max_len, size, max_len).tolist() + [size]
    pad_ends = pad_ends if size > num_tokens else []
    offsets = np.concatenate([query_start_loc, pad_ends]).astype(np.int32)
    assert len(offsets) <= num_slots + 1, (len(offsets), num_slots)
    out = np.full(num_slots + 1, size, dtype=np.int32)
    out[: len(offsets)] = offsets
    return out


class EncoderGraphs:
    """Captures one graph per size of `graph_sizes(max_tokens)` (one shared memory pool) and
    replays a step on the smallest that holds it."""

    def __init__(
        self,
        model: Any,
        builder: Any,
        layer_names: list[str],
        device: torch.device,
        max_tokens: int,
        max_reqs: int,
        max_len: int,
    ) -> None:
        self.model = model
        self.builder = builder
        self.layer_names = layer_names
        self.max_len = max_len
        self.sizes = graph_sizes(max_tokens)
        self.num_slots = max_reqs + -(-self.sizes[0] // max_len)
        """Request slots of the offsets: every request, plus the padding's sequences."""
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.token_type_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.offsets = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=device)
        self.lens = torch.zeros(self.num_slots, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _metadata(self, size: int) -> dict[str, Any]:
        # Host copies describe one sequence of `size` tokens: the builder keeps the varlen
        # path (not the equal-length one); the kernel reads the device offsets at replay.
        qsl_cpu = torch.zeros(self.num_slots + 1, dtype=torch.int32)
        qsl_cpu[1:] = size
        common = CommonAttentionMetadata(
            query_start_loc=self.offsets,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self.lens,
            seq_lens_cpu=torch.diff(qsl_cpu),
            num_reqs=self.num_slots,
            num_actual_tokens=size,
            max_query_len=self.max_len,
            max_seq_len=self.max_len,
            causal=False,
            query_positions=self.positions[:size],
        )
        return dict.fromkeys(self.layer_names, self.builder.build(common))

    def _forward(self, size: int, metadata: dict[str, Any]) -> torch.Tensor:
        with set_forward_context(ForwardContext(metadata)):
            return self.model(
                self.input_ids[:size],
                self.positions[:size],
                token_type_ids=self.token_type_ids[:size],
            )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            # Capture-time offsets: one sequence of all `size` rows (the kernel computes its
            # first max_len; the values of a capture are never read).
            capture = np.full(self.num_slots + 1, size, dtype=np.int32)
            capture[0] = 0
            self.offsets.copy_(torch.from_numpy(capture))
            self.lens.copy_(torch.from_numpy(np.diff(capture)))
            # Warm-up (kernels compile outside the capture) on metadata of its own: a backend
            # may keep per-step tensors on its metadata (the Triton encoder-only tile table),
            # which the capture must make itself, so that every replay remakes them.
            self._forward(size, self._metadata(size))
            metadata = self._metadata(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._forward(size, metadata)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, output)
        logger.info(
            "captured encoder CUDA graphs for %d token counts up to %d", len(self.sizes), size
        )

    def fits(self, num_tokens: int) -> bool:
        """Whether a graph holds a step of `num_tokens` (of at most max_reqs requests)."""
        return num_tokens <= self.sizes[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        query_start_loc: np.ndarray,
    ) -> torch.Tensor:
        """The step's real tokens (device tensors of at least T rows, T = query_start_loc[-1];
        token_type_ids None: segment 0 for all) -> hidden states [T, H] (a view of the graph's
        output, valid until the next replay)."""
        num_tokens = int(query_start_loc[-1])
        size = next(s for s in self.sizes if s >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids[:num_tokens], non_blocking=True)
        self.positions[:num_tokens].copy_(positions[:num_tokens], non_blocking=True)
        if token_type_ids is None:
            self.token_type_ids[:num_tokens].zero_()
        else:
            self.token_type_ids[:num_tokens].copy_(token_type_ids[:num_tokens], non_blocking=True)
        # Padding rows: position 0 (RoBERTa's positions index back from it), any valid id.
        self.positions[num_tokens:size].zero_()
        self._copy_offsets(query_start_loc, size)
        graph, output = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return output[:num_tokens]

    def _copy_offsets(self, query_start_loc: np.ndarray, size: int) -> None:
        offsets = graph_offsets(query_start_loc, size, self.num_slots, self.max_len)
        both = np.concatenate([offsets, np.diff(offsets)]).astype(np.int32)
        src = to_device(both, self.offsets.device)
        self.offsets.copy_(src[: len(offsets)], non_blocking=True)
        self.lens.copy_(src[len(offsets) :], non_blocking=True)


def make_encoder_graphs(
    model: Any,
    attn_metadata: Any,
    layer_names: list[str],
    device: torch.device,
    max_tokens: int,
    max_reqs: int,
    max_len: int,
) -> EncoderGraphs | None:
    """Graphs for a CUDA encoder-only model in 16 bits whose backend declares encoder graphs
    (None otherwise, for a position limit past MAX_GRAPH_LEN, or with `V1_CUDNN_VARLEN`)."""
    dtype = next(model.parameters()).dtype
    if (
        device.type != "cuda"
        or not attn_metadata.backend.capabilities.encoder_cuda_graphs
        or dtype not in (torch.float16, torch.bfloat16)
        or max_len > MAX_GRAPH_LEN
    ):
        return None
    if envs.V1_CUDNN_VARLEN:
        # torch's ragged cuDNN attention (aten._cudnn_attention_forward with offsets) builds
        # or looks up its cuDNN execution plan on the host at every call (several torch
        # releases build it anew each call, with no plan cache for this path); stream capture
        # does not allow that: the capture broke in the GEMM after the first attention
        # (cublasLt CUBLAS_STATUS_EXECUTION_FAILED, then "operation failed due to a previous
        # error during capture", H200, torch 2.11).
        logger.warning(
            "V1_CUDNN_VARLEN is set: encoder-only steps run eagerly, without CUDA graphs "
            "(cuDNN's ragged attention cannot be captured)"
        )
        return None
    builder = attn_metadata.backend.get_builder_cls()(AttentionType.ENCODER_ONLY, device, 0)
    graphs = EncoderGraphs(model, builder, layer_names, device, max_tokens, max_reqs, max_len)
    graphs.capture()
    return graphs
