"""CUDA graphs for decoder steps whose queries are all short (decodes, short first steps, small
chunks): a graph per padded token count T serves any step of at most T tokens whose queries fit
the backend's `graph_max_query_len`, so each request is one work item (request i, block 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.attention.backend import AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from v1.forward_context import ForwardContext, set_forward_context
from v1.host_copy import to_device
from v1.logger import init_logger

if TYPE_CHECKING:
    from v1.core.sched_output import SchedulerOutput
    from v1.worker.attn_metadata import AttentionMetadataFactory
    from v1.worker.input_batch import InputBatch
    from v1.worker.step_inputs import StepInputs

logger = init_logger(__name__)

MAX_GRAPH_TOKENS = 512
"""Largest graph: a full decode batch plus a few new requests' first steps."""

DecodeForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(input_ids [T], positions [T]) -> hidden states [T, H] under the caller's forward context:
the model state's `decode_forward`, what a graph captures."""


def capture_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, every 8 below 256, every 16 from 256 (vLLM's sizes), and `max_tokens`."""
    sizes = [s for s in (1, 2, 4) if s < max_tokens]
    sizes += list(range(8, min(max_tokens, 256), 8)) + list(range(256, max_tokens, 16))
    return sorted(set(sizes + [max_tokens]))


def graph_max_tokens(max_num_reqs: int, max_num_batched_tokens: int, max_query_len: int) -> int:
    """No step has more tokens than the budget, and a graphed step has at most
    `max_query_len` tokens for each of at most `max_num_reqs` requests."""
    return min(max_num_batched_tokens, max_query_len * max_num_reqs, MAX_GRAPH_TOKENS)


def padded(values: np.ndarray, size: int, fill: int, dtype: type) -> np.ndarray:
    """`values` followed by `fill` up to `size` entries (graph buffers for padding rows)."""
    out = np.full(size, fill, dtype=dtype)
    out[: len(values)] = values
    return out


def graph_query_start_loc(query_start_loc: np.ndarray, size: int) -> np.ndarray:
    """[size + 1] int32 offsets of `size` requests over `size` token rows: the real requests,
    then one single-token request per padding row (seq_len 0: the kernel writes zeros there,
    so padding rows hold no stale values), then empty requests."""
    num_tokens = int(query_start_loc[-1])
    out = np.full(size + 1, size, dtype=np.int32)
    out[: len(query_start_loc)] = query_start_loc
    pad_end = len(query_start_loc) + size - num_tokens
    out[len(query_start_loc) : pad_end] = np.arange(num_tokens + 1, size + 1)
    return out


def static_common(
    size: int,
    buffers: dict[str, torch.Tensor | None],
    max_query_len: int,
    causal: bool,
    max_seq_len: int,
) -> CommonAttentionMetadata:
    """The metadata a graph of `size` tokens is captured with: device tensors are `size`-row
    views of the static buffers (query_start_loc, seq_lens, block_table, slot_mapping,
    positions); the host copies describe one token per request, so the builder makes exactly
    one work item per request whatever the replayed query lengths (each <= max_query_len)."""
    slot_mapping = buffers["slot_mapping"]
    return CommonAttentionMetadata(
        query_start_loc=buffers["query_start_loc"][: size + 1],
        query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
        seq_lens=buffers["seq_lens"][:size],
        seq_lens_cpu=torch.ones(size, dtype=torch.int32),
        num_reqs=size,
        num_actual_tokens=size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        causal=causal,
        block_table=buffers["block_table"][:size],
        slot_mapping=None if slot_mapping is None else slot_mapping[:size],
        query_positions=buffers["positions"][:size],
    )


def check_static_work(
    builder: AttentionMetadataBuilder, metadata: Any, size: int, max_query_len: int
) -> None:
    """Replays reuse the work items built at capture: one per request, `max_query_len` rows."""
    work = builder.graph_work(metadata)
    if work is None or work != (size, max_query_len):
        raise RuntimeError(
            f"CUDA graphs need one work item of {max_query_len} query rows per request; the "
            f"backend built (items, rows) {work} for {size} requests"
        )


class CudaGraphManager:
    """Captures one graph per size in `sizes` (one shared memory pool) and replays decoder
    steps on them; the runner asks `can_run` first and runs the others eagerly.

    It reads the KV groups' builders and block tables from `attn_metadata`, the batch's
    encoder lengths from `input_batch`, and captures `decode_forward`."""

    def __init__(
        self,
        attn_metadata: AttentionMetadataFactory,
        input_batch: InputBatch,
        decode_forward: DecodeForward,
        max_tokens: int,
        max_query_len: int,
    ) -> None:
        self.attn_metadata = attn_metadata
        self.input_batch = input_batch
        self.decode_forward = decode_forward
        self.max_tokens = max_tokens
        self.max_query_len = max_query_len
        self.sizes = capture_sizes(max_tokens)
        device = attn_metadata.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)
        self.seq_lens: list[torch.Tensor] = []
        self.block_tables: list[torch.Tensor] = []
        self.slot_mappings: list[torch.Tensor | None] = []
        """Per KV group (cross groups write nothing in a graphed step: None)."""
        tables = attn_metadata.block_tables
        for table, attn_type in zip(tables, attn_metadata.group_types, strict=True):
            self.seq_lens.append(torch.zeros(max_tokens, dtype=torch.int32, device=device))
            self.block_tables.append(
                torch.zeros((max_tokens, table.table.shape[1]), dtype=torch.int32, device=device)
            )
            self.slot_mappings.append(
                torch.full((max_tokens,), -1, dtype=torch.long, device=device)
                if attn_type == AttentionType.DECODER
                else None
            )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, Any]]] = {}
        self.pool = None
        self.num_replays = 0
        self.num_mixed_replays = 0
        """Replays of steps with a query longer than one token (first steps, chunks)."""
        self.num_eager_steps = 0
        """Decoder steps `can_run` turned down."""

    @classmethod
    def create(
        cls,
        attn_metadata: AttentionMetadataFactory,
        input_batch: InputBatch,
        decode_forward: DecodeForward,
        max_num_batched_tokens: int,
    ) -> CudaGraphManager:
        """Sized for the scheduler's limits and the backend's graph query length."""
        max_query_len = attn_metadata.backend.capabilities.graph_max_query_len
        max_tokens = graph_max_tokens(
            input_batch.max_num_reqs, max_num_batched_tokens, max_query_len
        )
        return cls(attn_metadata, input_batch, decode_forward, max_tokens, max_query_len)

    # ---- capture ----
    def _metadata(self, size: int) -> dict[str, Any]:
        groups = self.attn_metadata
        out: dict[str, Any] = {}
        for i, attn_type in enumerate(groups.group_types):
            buffers = {
                "query_start_loc": self.query_start_loc,
                "seq_lens": self.seq_lens[i],
                "block_table": self.block_tables[i],
                "slot_mapping": self.slot_mappings[i],
                "positions": self.positions,
            }
            block_size = groups.block_tables[i].block_size
            max_seq_len = self.block_tables[i].shape[1] * block_size
            causal = attn_type == AttentionType.DECODER
            common = static_common(size, buffers, self.max_query_len, causal, max_seq_len)
            metadata = groups.builders[i].build(common)
            check_static_work(groups.builders[i], metadata, size, self.max_query_len)
            out.update(dict.fromkeys(groups.group_layers[i], metadata))
        return out

    def _forward(self, size: int, metadata: dict[str, Any]) -> torch.Tensor:
        with set_forward_context(ForwardContext(metadata)):
            return self.decode_forward(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        # Every request reads and writes nothing while capturing: seq_len 0, slot -1.
        for lens in self.seq_lens:
            lens.zero_()
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            self._forward(size, metadata)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._forward(size, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, output, metadata)
        logger.info(
            "captured CUDA graphs for %d token counts up to %d (queries up to %d tokens)",
            len(self.sizes),
            self.max_tokens,
            self.max_query_len,
        )

    # ---- replay ----
    def can_run(self, step: StepInputs, so: SchedulerOutput) -> bool:
        """Whether a graph serves this decoder step (cross-K/V writes of first steps run in
        their own pre-step, so they exclude nothing). Called once per decoder step."""
        fits = (
            step.num_tokens <= self.max_tokens
            and int(step.num_scheduled.max(initial=0)) <= self.max_query_len
        )
        if not fits:
            self.num_eager_steps += 1
        return fits

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replays the smallest graph that fits; hidden states of the real tokens [T, H]."""
        size = self.prepare(step)
        graph, output, _ = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        if step.num_tokens > len(step.req_ids):
            self.num_mixed_replays += 1
        return output[: step.num_tokens]

    def prepare(self, step: StepInputs) -> int:
        """Copies the step into the static buffers of the smallest graph that fits and returns
        its size. Padding requests get seq_len 0 and padding tokens slot -1: they read and write
        no cache. Padding tokens keep stale ids and positions, which are valid (they were real
        once, or zeros)."""
        groups = self.attn_metadata
        num_tokens, num_reqs = step.num_tokens, len(step.req_ids)
        size = next(s for s in self.sizes if s >= num_tokens)
        device_copies = [
            (self.input_ids[:num_tokens], step.input_ids[:num_tokens]),
            (self.positions[:num_tokens], step.positions[:num_tokens]),
        ]
        qsl = graph_query_start_loc(step.query_start_loc, size)
        copies = [(self.query_start_loc[: size + 1], qsl)]
        batch = self.input_batch
        for i, attn_type in enumerate(groups.group_types):
            table = groups.block_tables[i]
            if attn_type == AttentionType.DECODER:
                lens = step.seq_lens
                slots = table.slot_mapping(step.token_slots, step.positions_np)
                copies.append((self.slot_mappings[i][:size], padded(slots, size, -1, np.int64)))
            else:
                lens = batch.num_encoder_tokens[step.slots]
            copies.append((self.seq_lens[i][:size], padded(lens, size, 0, np.int32)))
            # Columns past the widest row this step are never read (as in BlockTable.rows).
            width = max(int(table.num_blocks[step.slots].max(initial=1)), 1)
            copies.append(
                (self.block_tables[i][:num_reqs, :width], table.table[step.slots, :width])
            )
        self._copy_all(copies, device_copies)
        return size

    def _copy_all(
        self,
        copies: list[tuple[torch.Tensor, np.ndarray]],
        device_copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Host arrays into static buffers through ONE pinned host-to-device copy (each pinned
        buffer costs tens of microseconds of host time), then all device-side copies (these
        and `device_copies`) in one foreach call."""
        flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for _, a in copies])
        src = to_device(flat, self.input_ids.device)
        dsts, srcs = [d for d, _ in device_copies], [s for _, s in device_copies]
        start = 0
        for dst, array in copies:
            n = array.size
            dsts.append(dst)
            srcs.append(src[start : start + n].view(array.shape))
            start += n
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
