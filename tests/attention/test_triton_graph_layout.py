"""The Triton kernel on the CUDA-graph layout of v1/worker/cuda_graphs.py: a step's requests
padded to the graph's token count (single-token padding requests own the padding rows, then
empty ones; seq_len 0, slot -1), one work item per request of DECODE_BLOCK_M query rows; run
eagerly on that layout, then captured once with empty buffers and replayed over several steps.

Marked `gpu`; skipped without CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from shapes import CROSS, DEC, SHAPES, Batch, make_batch, make_relative_bias

from v1.attention.backend import AttentionType, RelativePositionBias
from v1.attention.ops.reference import write_kv_cache
from v1.worker.cuda_graphs import check_static_work, graph_query_start_loc, padded, static_common

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
SIZE = 16
"""The graph's token count (every shape below has at most 16 tokens)."""
MAX_BLOCKS, WIDTH = 64, 32
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 16
"""The default BatchShape head layout: the shapes below share one static cache."""
SHAPES_OF = {
    DEC: ["decode", "decode_padded", "mixed_padded", "decode_long"],
    CROSS: ["cross", "cross_decode"],
}
GARBAGE = 1e3


def static_buffers(attn_type: AttentionType) -> dict[str, torch.Tensor | None]:
    """What a graph reads, as captured: every request one token long, seq_len 0, slot -1."""
    device = DEVICE
    return {
        "query_start_loc": torch.arange(SIZE + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.zeros(SIZE, dtype=torch.int32, device=device),
        "block_table": torch.zeros(SIZE, WIDTH, dtype=torch.int32, device=device),
        "slot_mapping": (
            torch.full((SIZE,), -1, dtype=torch.long, device=device) if attn_type == DEC else None
        ),
        "positions": torch.zeros(SIZE, dtype=torch.long, device=device),
        "query": torch.zeros(SIZE, HEADS, DIM, device=device),
        "key": torch.zeros(SIZE, KV_HEADS, DIM, device=device),
        "value": torch.zeros(SIZE, KV_HEADS, DIM, device=device),
        "kv_cache": torch.zeros(2, MAX_BLOCKS, BLOCK, KV_HEADS, DIM, device=device),
    }


def fill(buffers: dict[str, torch.Tensor | None], batch: Batch) -> None:
    """The step in the graph layout. Cross K/V of first steps is written beforehand, as the
    runner's cross-K/V pre-step does; padding rows carry garbage queries and keys."""
    shape, common = batch.shape, batch.common
    n, num_reqs = shape.num_tokens, shape.num_reqs
    num_blocks, width = batch.kv_cache.shape[1], common.block_table.shape[1]
    assert n <= SIZE and num_blocks <= MAX_BLOCKS and width <= WIDTH, shape.name
    qsl = graph_query_start_loc(common.query_start_loc_cpu.numpy(), SIZE)
    buffers["query_start_loc"].copy_(torch.from_numpy(qsl))
    seq_lens = padded(common.seq_lens_cpu.numpy(), SIZE, 0, np.int32)
    buffers["seq_lens"].copy_(torch.from_numpy(seq_lens))
    buffers["block_table"].fill_(7)  # stale rows: padding requests must never read them
    buffers["block_table"][:num_reqs, :width] = common.block_table
    buffers["positions"].zero_()
    buffers["positions"][:n] = common.query_positions
    buffers["query"].fill_(GARBAGE)
    buffers["query"][:n] = batch.query[:n]
    buffers["kv_cache"].zero_()
    buffers["kv_cache"][:, :num_blocks] = batch.kv_cache
    if batch.attn_type == DEC:
        slots = padded(common.slot_mapping[:n].cpu().numpy(), SIZE, -1, np.int64)
        buffers["slot_mapping"].copy_(torch.from_numpy(slots))
        for name, rows in (("key", batch.key), ("value", batch.value)):
            buffers[name].fill_(GARBAGE)
            buffers[name][:n] = rows[:n]
    elif batch.key is not None:
        write_kv_cache(batch.key, batch.value, buffers["kv_cache"], common.slot_mapping)


def build_metadata(buffers: dict[str, torch.Tensor | None], attn_type: AttentionType) -> Any:
    from v1.attention.backends.triton import DECODE_BLOCK_M, TritonMetadataBuilder

    common = static_common(SIZE, buffers, DECODE_BLOCK_M, attn_type == DEC, WIDTH * BLOCK)
    builder = TritonMetadataBuilder(attn_type, torch.device(DEVICE), BLOCK)
    metadata = builder.build(common)
    check_static_work(builder, metadata, SIZE, DECODE_BLOCK_M)
    return metadata


def forward(
    buffers: dict[str, torch.Tensor | None],
    metadata: Any,
    attn_type: AttentionType,
    bias: RelativePositionBias | None,
) -> torch.Tensor:
    from v1.attention.backends.triton import TritonImpl

    impl = TritonImpl(HEADS, DIM, DIM**-0.5, KV_HEADS, attn_type)
    paged_key = attn_type == DEC
    return impl.forward(
        buffers["query"],
        buffers["key"] if paged_key else None,
        buffers["value"] if paged_key else None,
        buffers["kv_cache"],
        metadata,
        bias,
    )


def make_step(
    shape_name: str, attn_type: AttentionType, with_bias: bool, seed: int
) -> tuple[Batch, RelativePositionBias | None, torch.Tensor]:
    """(batch, bias or None, expected output of the real rows)."""
    batch = make_batch(SHAPES[shape_name], attn_type, torch.float32, DEVICE, seed=seed)
    shape = batch.shape
    assert (shape.num_heads, shape.num_kv_heads, shape.head_size, shape.block_size) == (
        HEADS,
        KV_HEADS,
        DIM,
        BLOCK,
    )
    if not with_bias:
        return batch, None, batch.expected
    bias, per_req = make_relative_bias(batch, seed=7)
    return batch, bias, batch.reference(per_req)


def assert_step(
    out: torch.Tensor, buffers: dict[str, Any], batch: Batch, expected: torch.Tensor
) -> None:
    n, num_blocks = batch.shape.num_tokens, batch.kv_cache.shape[1]
    torch.testing.assert_close(out[:n], expected, atol=1e-5, rtol=1e-5)
    # Padding rows belong to single-token requests with nothing to attend: zeros, not stale.
    assert not out[n:].any()
    cache = buffers["kv_cache"]
    assert torch.equal(cache[:, :num_blocks], batch.expected_kv_cache)
    assert not cache[:, num_blocks:].any(), "something was written outside the step's slots"


CASES = [
    pytest.param(name, t, bias, id=f"{name}-{t.value}{'-relative' if bias else ''}")
    for t, names in SHAPES_OF.items()
    for name in names
    for bias in ([False, True] if t == DEC else [False])
]


@pytest.mark.parametrize(("shape_name", "attn_type", "with_bias"), CASES)
def test_kernel_on_the_graph_layout(shape_name: str, attn_type: AttentionType, with_bias: bool):
    batch, bias, expected = make_step(shape_name, attn_type, with_bias, seed=11)
    buffers = static_buffers(attn_type)
    fill(buffers, batch)
    out = forward(buffers, build_metadata(buffers, attn_type), attn_type, bias)
    assert_step(out, buffers, batch, expected)


@pytest.mark.parametrize(
    ("attn_type", "with_bias"),
    # T5's relative bias is on decoder self-attention only.
    [(DEC, False), (DEC, True), (CROSS, False)],
    ids=["decoder-plain", "decoder-relative", "cross-plain"],
)
def test_one_capture_replays_every_step(attn_type: AttentionType, with_bias: bool) -> None:
    steps = [make_step(name, attn_type, with_bias, seed=12) for name in SHAPES_OF[attn_type]]
    buffers = static_buffers(attn_type)
    bias = None
    if with_bias:
        first = steps[0][1]
        table = first.table.clone()  # the graph reads this one tensor
        bias = RelativePositionBias(
            table, first.num_buckets, first.max_distance, first.bidirectional
        )
    metadata = build_metadata(buffers, attn_type)
    forward(buffers, metadata, attn_type, bias)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(buffers, metadata, attn_type, bias)
    for batch, step_bias, expected in steps + steps[::-1]:  # reversed: shrink and grow again
        fill(buffers, batch)
        if step_bias is not None:
            assert torch.equal(step_bias.table, bias.table)
        graph.replay()
        torch.cuda.synchronize()
        assert_step(out, buffers, batch, expected)
