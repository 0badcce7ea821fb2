"""CUDA graphs for uniform decode steps (every request schedules one token).

Graphs are captured for padded batch sizes over static input and metadata buffers; a step
copies its inputs into the buffers (padding rows get seq_len 0 and slot -1, so they neither
read nor write the cache) and replays the smallest graph that fits. Needs a backend whose
kernels take all step data from device buffers (Triton).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.attention.backend import AttentionType, CommonAttentionMetadata
from v1.forward_context import ForwardContext, set_forward_context
from v1.logger import init_logger

if TYPE_CHECKING:
    from v1.core.sched_output import SchedulerOutput
    from v1.worker.model_runner import ModelRunner, StepInputs

logger = init_logger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class CudaGraphManager:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        device = runner.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = []
        self.block_tables = []
        self.slot_mappings = []
        for table in runner.input_batch.block_tables:
            self.seq_lens.append(torch.zeros(max_batch, dtype=torch.int32, device=device))
            self.block_tables.append(
                torch.zeros((max_batch, table.table.shape[1]), dtype=torch.int32, device=device)
            )
            self.slot_mappings.append(torch.full((max_batch,), -1, dtype=torch.long, device=device))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, Any]]] = {}
        self.pool = None

    # ---- capture ----
    def _metadata(self, batch: int) -> dict[str, Any]:
        runner = self.runner
        out: dict[str, Any] = {}
        for i, attn_type in enumerate(runner.group_types):
            decoder = attn_type == AttentionType.DECODER
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[: batch + 1],
                query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
                seq_lens=self.seq_lens[i][:batch],
                seq_lens_cpu=torch.ones(batch, dtype=torch.int32),
                num_reqs=batch,
                num_actual_tokens=batch,
                max_query_len=1,
                max_seq_len=self.block_tables[i].shape[1] * runner.block_size,
                causal=decoder,
                block_table=self.block_tables[i][:batch],
                slot_mapping=self.slot_mappings[i][:batch] if decoder else None,
                query_positions=self.positions[:batch],
            )
            out.update(dict.fromkeys(runner.group_layers[i], runner.builders[i].build(common)))
        return out

    def _forward(self, batch: int, metadata: dict[str, Any]) -> torch.Tensor:
        with set_forward_context(ForwardContext(metadata)):
            return self.runner.state.decode_forward(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        for table in self.seq_lens:
            table.zero_()
        for batch in reversed(self.sizes):
            metadata = self._metadata(batch)
            self._forward(batch, metadata)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._forward(batch, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = (graph, output, metadata)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    # ---- replay ----
    def can_run(self, step: StepInputs, so: SchedulerOutput) -> bool:
        # Cross-K/V writes of first steps run in their own pre-step, so they need no exclusion.
        return len(step.req_ids) <= self.max_batch and step.num_tokens == len(step.req_ids)

    def run(self, step: StepInputs) -> torch.Tensor:
        runner = self.runner
        num = len(step.req_ids)
        batch = next(s for s in self.sizes if s >= num)
        graph, output, _ = self.graphs[batch]
        self.input_ids[:num].copy_(step.input_ids)
        self.positions[:num].copy_(step.positions)
        self.input_ids[num:batch].zero_()
        self.positions[num:batch].zero_()
        for i, attn_type in enumerate(runner.group_types):
            table = runner.input_batch.block_tables[i]
            if attn_type == AttentionType.DECODER:
                lens = step.seq_lens
                slots = table.slot_mapping(step.token_slots, step.positions_np)
                self.slot_mappings[i][:num].copy_(torch.from_numpy(slots), non_blocking=True)
                self.slot_mappings[i][num:batch].fill_(-1)
            else:
                lens = runner.input_batch.num_encoder_tokens[step.slots]
            rows = table.table[step.slots]
            self.seq_lens[i][:num].copy_(torch.from_numpy(lens.astype(np.int32)), non_blocking=True)
            self.seq_lens[i][num:batch].zero_()
            self.block_tables[i][:num].copy_(torch.from_numpy(rows), non_blocking=True)
        graph.replay()
        return output[:num]
