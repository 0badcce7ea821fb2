"""Named attention batch shapes and `make_batch`: random q/k/v over a shuffled paged cache, the
step's CommonAttentionMetadata, and the expected output from the per-request `naive_attention`;
plus random biases (materialized, T5 relative) with their per-request expansion.

Every backend (torch_sdpa now, Triton / flash-attn later) is tested on these same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.attention.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    MaterializedBias,
    RelativePositionBias,
)
from v1.attention.ops.reference import naive_attention
from v1.attention.ops.t5_bias import relative_position_bucket

DEC = AttentionType.DECODER
ENC = AttentionType.ENCODER
ENC_ONLY = AttentionType.ENCODER_ONLY
CROSS = AttentionType.ENCODER_DECODER

NUM_SPARE_BLOCKS = 5
"""Blocks no request owns: a backend writing outside its slots shows up there."""
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class LoadedBackend:
    """The backend under test (the `backend` fixture) and the device it runs on."""

    cls: type[AttentionBackend]
    device: torch.device


@dataclass(frozen=True)
class BatchShape:
    name: str
    query_lens: tuple[int, ...]
    """Query tokens of each request this step."""
    context_lens: tuple[int, ...] | None = None
    """Tokens already in the cache before this step (decoder side); None means all 0."""
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    attn_types: tuple[AttentionType, ...] = (DEC,)
    """The attention types this shape is meaningful for."""
    encoder_lens: tuple[int, ...] | None = None
    """Cross-attention key length of each request (ENCODER_DECODER only)."""
    cross_writes: tuple[bool, ...] | None = None
    """Which requests write their cross K/V this step; the others only read it."""
    num_pad_tokens: int = 0
    """Padding rows after the real tokens (CUDA-graph style): slot -1, output ignored."""

    def __post_init__(self) -> None:
        num_reqs = len(self.query_lens)
        assert num_reqs > 0 and min(self.query_lens) >= 1, self.name
        assert len(self.ctx) == num_reqs, self.name
        assert self.num_heads % self.num_kv_heads == 0, self.name
        if self.encoder_lens is not None:
            assert len(self.encoder_lens) == num_reqs and min(self.encoder_lens) >= 1
            assert self.cross_writes is not None and len(self.cross_writes) == num_reqs
        if {ENC, ENC_ONLY} & set(self.attn_types):
            assert not any(self.ctx), f"{self.name}: encoder types have no context"
        if CROSS in self.attn_types:
            assert self.encoder_lens is not None, self.name

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def ctx(self) -> tuple[int, ...]:
        return self.context_lens or (0,) * len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


_SHAPES = [
    # Decode: one token per request; context lengths straddle block boundaries (bs=16).
    BatchShape("decode", (1,) * 8, context_lens=(0, 1, 14, 15, 16, 31, 32, 70)),
    BatchShape("decode_single", (1,), context_lens=(47,)),
    BatchShape("decode_mha", (1,) * 4, context_lens=(3, 15, 16, 40), num_kv_heads=4),
    BatchShape("decode_mqa", (1,) * 4, context_lens=(8, 16, 17, 63), num_heads=8, num_kv_heads=1),
    BatchShape("decode_padded", (1,) * 5, context_lens=(2, 15, 16, 30, 9), num_pad_tokens=3),
    BatchShape("decode_block8", (1,) * 5, context_lens=(7, 8, 9, 23, 24), block_size=8),
    # Distances past T5's max_distance (128) reach the last relative-position bucket.
    BatchShape("decode_long", (1, 1), context_lens=(150, 300)),
    # Prefill: no context; lengths 1, below/at/above a block, several blocks.
    BatchShape("prefill", (1, 7, 16, 17, 40), attn_types=(DEC, ENC, ENC_ONLY)),
    BatchShape("prefill_mha", (5, 33, 1), num_kv_heads=4, attn_types=(DEC, ENC, ENC_ONLY)),
    # Mixed: decodes, fresh prefills and chunked-prefill continuations in one batch.
    BatchShape("mixed", (1, 9, 1, 21, 1, 3), context_lens=(20, 0, 33, 16, 0, 5)),
    BatchShape(
        "mixed_gqa",
        (1, 12, 1, 7),
        context_lens=(17, 0, 64, 9),
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
    ),
    BatchShape("mixed_padded", (1, 6, 4), context_lens=(31, 0, 12), num_pad_tokens=4),
    # Chunked prefill: every request continues a prefill.
    BatchShape("chunked", (16, 11, 7, 30), context_lens=(16, 5, 48, 1), block_size=8),
    # Encoder: bidirectional, no cache.
    BatchShape("encoder", (37, 37, 12, 1, 20), num_heads=6, num_kv_heads=6, attn_types=(ENC,)),
    BatchShape("encoder_only", (5, 1, 23, 64, 9), num_kv_heads=4, attn_types=(ENC_ONLY, ENC)),
    BatchShape("encoder_padded", (9, 3), num_pad_tokens=5, attn_types=(ENC_ONLY,)),
    # BERT's and MiniLM's heads (64 and 32, MHA): on a GPU in 16 bits, the Triton encoder-only
    # kernel; lengths below, at and past its tiles of 64 and 32 rows, up to BERT's 512.
    BatchShape(
        "encoder_only_bert",
        (1, 63, 64, 65, 200, 512, 17),
        num_heads=12,
        num_kv_heads=12,
        head_size=64,
        num_pad_tokens=5,
        attn_types=(ENC_ONLY,),
    ),
    BatchShape(
        "encoder_only_minilm",
        (16, 129, 256, 3, 32, 33),
        num_heads=12,
        num_kv_heads=12,
        head_size=32,
        attn_types=(ENC_ONLY,),
    ),
    # Equal lengths (Whisper's windows): one dense batch on the GPU.
    BatchShape("encoder_uniform", (37, 37, 37), num_heads=6, num_kv_heads=6, attn_types=(ENC,)),
    BatchShape(
        "encoder_uniform_padded",
        (24, 24),
        num_heads=4,
        num_kv_heads=4,
        num_pad_tokens=3,
        attn_types=(ENC_ONLY,),
    ),
    # Cross: decoder queries over encoder K/V (Whisper's 1500 scaled to 37). Requests on their
    # first step write their cross K/V, the others only read it, in one batch.
    BatchShape(
        "cross",
        (1, 4, 1, 3, 1, 2),
        context_lens=(9, 0, 30, 0, 2, 0),
        encoder_lens=(37, 37, 37, 20, 37, 5),
        cross_writes=(False, True, False, True, False, True),
        attn_types=(CROSS,),
    ),
    BatchShape(
        "cross_decode",
        (1, 1, 1),
        context_lens=(3, 17, 40),
        encoder_lens=(37, 16, 33),
        cross_writes=(False, False, False),
        attn_types=(CROSS,),
    ),
    BatchShape(
        "cross_prefill",
        (1, 5, 2),
        encoder_lens=(37, 17, 32),
        cross_writes=(True, True, True),
        num_heads=6,
        num_kv_heads=6,
        attn_types=(CROSS,),
    ),
    BatchShape(
        "cross_gqa_padded",
        (1, 3, 1),
        context_lens=(4, 0, 11),
        encoder_lens=(37, 24, 37),
        cross_writes=(False, True, False),
        num_heads=8,
        num_kv_heads=2,
        block_size=8,
        num_pad_tokens=2,
        attn_types=(CROSS,),
    ),
]
SHAPES: dict[str, BatchShape] = {shape.name: shape for shape in _SHAPES}


def shape_type_cases() -> list[tuple[str, AttentionType]]:
    """Every (shape name, attention type) pair the shape is meaningful for."""
    return [(shape.name, t) for shape in _SHAPES for t in shape.attn_types]


@dataclass
class Batch:
    shape: BatchShape
    attn_type: AttentionType
    query: torch.Tensor
    """[num_tokens + num_pad_tokens, H, D]."""
    key: torch.Tensor | None
    """[N, Hkv, D] rows this step provides (cross: the writers' encoder rows), or None."""
    value: torch.Tensor | None
    kv_cache: torch.Tensor
    """[2, num_blocks, block_size, Hkv, D]: poison, with the prior context already written."""
    expected_kv_cache: torch.Tensor
    """kv_cache after a correct step: this step's rows written, nothing else changed."""
    common: CommonAttentionMetadata
    block_ids: list[list[int]]
    keys: list[torch.Tensor]
    """Per request, every key it attends to this step [seq_len, Hkv, D] (the truth)."""
    values: list[torch.Tensor]
    query_positions: list[torch.Tensor]
    """Per request, the position of each query token in its sequence."""
    scale: float
    expected: torch.Tensor
    """[num_tokens, H, D] from naive_attention, no bias."""

    @property
    def causal(self) -> bool:
        return self.attn_type == DEC

    def queries(self, req: int) -> torch.Tensor:
        start = sum(self.shape.query_lens[:req])
        return self.query[start : start + self.shape.query_lens[req]]

    def reference(self, biases: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Per-request naive attention; biases[r] is [H, Q_r, K_r]."""
        outs = [
            naive_attention(
                self.queries(r),
                self.keys[r],
                self.values[r],
                self.scale,
                self.causal,
                None if biases is None else biases[r],
            )
            for r in range(self.shape.num_reqs)
        ]
        return torch.cat(outs)  # [num_tokens, H, D]

    def assert_output(self, out: torch.Tensor, expected: torch.Tensor | None = None) -> None:
        """out [T_padded, H, D] equals expected (default: no bias) on the real tokens. Padding
        rows stay in the output: the layer reshapes to the padded token count."""
        assert out.shape == self.query.shape
        tol = TOLERANCE[self.query.dtype]
        expected = self.expected if expected is None else expected
        torch.testing.assert_close(out[: self.shape.num_tokens], expected, atol=tol, rtol=tol)


def _key_lens(shape: BatchShape, attn_type: AttentionType) -> list[int]:
    if attn_type == DEC:
        return [c + q for c, q in zip(shape.ctx, shape.query_lens, strict=True)]
    if attn_type == CROSS:
        return list(shape.encoder_lens)
    return list(shape.query_lens)


def _assign_blocks(
    key_lens: list[int], block_size: int, paged: bool, gen: torch.Generator
) -> tuple[list[list[int]], int]:
    """Shuffled, non-contiguous block ids per request; block 0 is the null block and never
    handed out, and NUM_SPARE_BLOCKS belong to nobody. Returns (block_ids, num_blocks)."""
    blocks_per_req = [-(-n // block_size) if paged else 0 for n in key_lens]
    num_blocks = 1 + sum(blocks_per_req) + NUM_SPARE_BLOCKS
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_ids, start = [], 0
    for n in blocks_per_req:
        block_ids.append(perm[start : start + n])
        start += n
    return block_ids, num_blocks


@dataclass
class _StepRows:
    """What one step writes: K/V rows handed to the backend and their slots."""

    key_rows: list[torch.Tensor]
    value_rows: list[torch.Tensor]
    slots: list[int]


def _fill_caches(
    shape: BatchShape,
    attn_type: AttentionType,
    kv: tuple[list[torch.Tensor], list[torch.Tensor]],
    block_ids: list[list[int]],
    caches: tuple[torch.Tensor, torch.Tensor],
) -> _StepRows:
    """Write the prior context into caches[0] and everything a correct step leaves into
    caches[1]; return the rows this step provides (decoder: the new tokens; cross: the
    writers' encoder rows; cache-less: the query tokens)."""
    keys, values = kv
    bs = shape.block_size
    rows = _StepRows([], [], [])

    def put(cache: torch.Tensor, req: int, positions: range) -> None:
        for pos in positions:
            block, off = block_ids[req][pos // bs], pos % bs
            cache[0, block, off] = keys[req][pos]
            cache[1, block, off] = values[req][pos]

    def provide(req: int, positions: range) -> None:
        rows.key_rows.append(keys[req][positions.start : positions.stop])
        rows.value_rows.append(values[req][positions.start : positions.stop])
        if attn_type.has_kv_cache:
            rows.slots += [block_ids[req][p // bs] * bs + p % bs for p in positions]

    for r, key in enumerate(keys):
        everything = range(len(key))
        put(caches[1], r, everything if attn_type.has_kv_cache else range(0))
        if attn_type == DEC:
            put(caches[0], r, range(shape.ctx[r]))
            provide(r, range(shape.ctx[r], len(key)))
        elif attn_type == CROSS and not shape.cross_writes[r]:
            put(caches[0], r, everything)
        else:
            provide(r, everything)
    return rows


def _common_metadata(
    shape: BatchShape,
    attn_type: AttentionType,
    block_ids: list[list[int]],
    slots: list[int],
    query_positions: list[torch.Tensor],
    device: torch.device | str,
) -> CommonAttentionMetadata:
    key_lens = _key_lens(shape, attn_type)
    qsl = torch.tensor([0, *torch.tensor(shape.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(key_lens, dtype=torch.int32)
    block_table = slot_mapping = None
    if attn_type.has_kv_cache:
        # One spare null column, like the runner's wider persistent block table.
        block_table = torch.zeros(shape.num_reqs, max(map(len, block_ids)) + 1, dtype=torch.int32)
        for r, ids in enumerate(block_ids):
            block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        block_table = block_table.to(device)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_reqs=shape.num_reqs,
        num_actual_tokens=shape.num_tokens,
        max_query_len=max(shape.query_lens),
        max_seq_len=max(key_lens),
        causal=attn_type == DEC,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_positions=torch.cat(query_positions).to(device),
    )


def make_batch(
    shape: BatchShape,
    attn_type: AttentionType,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Batch:
    """A random step of `shape` as `attn_type` sees it, with its expected output and cache."""
    assert attn_type in shape.attn_types, f"{shape.name} is not a {attn_type.value} shape"
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim, pad = shape.num_kv_heads, shape.head_size, shape.num_pad_tokens
    key_lens = _key_lens(shape, attn_type)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    keys = [randn(n, kv_heads, dim) for n in key_lens]
    values = [randn(n, kv_heads, dim) for n in key_lens]
    query = randn(shape.num_tokens + pad, shape.num_heads, dim)
    block_ids, num_blocks = _assign_blocks(key_lens, shape.block_size, attn_type.has_kv_cache, gen)
    # Poison: finite, so masked-out reads of unwritten rows stay harmless.
    kv_cache = randn(2, num_blocks, shape.block_size, kv_heads, dim) * 10
    expected_kv_cache = kv_cache.clone()
    rows = _fill_caches(shape, attn_type, (keys, values), block_ids, (kv_cache, expected_kv_cache))
    # Padding rows carry garbage K/V and slot -1: a backend must skip them.
    if rows.key_rows and pad:
        rows.key_rows.append(randn(pad, kv_heads, dim) * 100)
        rows.value_rows.append(randn(pad, kv_heads, dim) * 100)
        if attn_type.has_kv_cache:
            rows.slots += [-1] * pad
    key = torch.cat(rows.key_rows) if rows.key_rows else None
    value = torch.cat(rows.value_rows) if rows.value_rows else None
    query_positions = [
        shape.ctx[r] + torch.arange(q) if attn_type in (DEC, CROSS) else torch.arange(q)
        for r, q in enumerate(shape.query_lens)
    ]
    common = _common_metadata(shape, attn_type, block_ids, rows.slots, query_positions, device)
    batch = Batch(
        shape=shape,
        attn_type=attn_type,
        query=query.to(device),
        key=None if key is None else key.to(device),
        value=None if value is None else value.to(device),
        kv_cache=kv_cache.to(device),
        expected_kv_cache=expected_kv_cache.to(device),
        common=common,
        block_ids=block_ids,
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
        query_positions=[p.to(device) for p in query_positions],
        scale=dim**-0.5,
        expected=torch.empty(0),
    )
    batch.expected = batch.reference()
    return batch


NUM_BUCKETS, MAX_DISTANCE = 32, 128
"""T5's defaults."""


def make_materialized_bias(batch: Batch, seed: int) -> tuple[MaterializedBias, list[torch.Tensor]]:
    """Random [R, H, max_q, max_k]; the padding holds a large value a misaligned read would
    notice (it stays finite so masked-out entries remain -inf)."""
    gen = torch.Generator().manual_seed(seed)
    shape, common = batch.shape, batch.common
    full = torch.full(
        (shape.num_reqs, shape.num_heads, common.max_query_len, common.max_seq_len), 1e4
    )
    per_req = []
    for r, num_q in enumerate(shape.query_lens):
        num_k = len(batch.keys[r])
        full[r, :, :num_q, :num_k] = torch.randn(shape.num_heads, num_q, num_k, generator=gen)
        per_req.append(full[r, :, :num_q, :num_k].to(batch.query.device))
    return MaterializedBias(full.to(batch.query.device)), per_req


def make_relative_bias(batch: Batch, seed: int) -> tuple[RelativePositionBias, list[torch.Tensor]]:
    """A random T5 table; the expected bias expands buckets per request at the true positions
    (query j of request r at context_len + j, key k at k)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(NUM_BUCKETS, batch.shape.num_heads, generator=gen).to(batch.query.device)
    bidirectional = batch.attn_type != DEC
    per_req = []
    for r, q_pos in enumerate(batch.query_positions):
        k_pos = torch.arange(len(batch.keys[r]), device=q_pos.device)
        rel = k_pos[None, :] - q_pos[:, None]  # [Q, K]
        buckets = relative_position_bucket(rel, bidirectional, NUM_BUCKETS, MAX_DISTANCE)
        per_req.append(table[buckets].permute(2, 0, 1))  # [H, Q, K]
    return RelativePositionBias(table, NUM_BUCKETS, MAX_DISTANCE, bidirectional), per_req
