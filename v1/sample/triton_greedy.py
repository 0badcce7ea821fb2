"""Greedy sampling of a step's logits in two Triton kernels: bans, forced tokens, argmax and
the sampled token's raw logprob and rank, reading each row of 16-bit logits once.
Must hold: the torch path of `graphed.dense_sample` is the reference; same argmax (first index
of the largest value), same rank rule, logprob equal up to float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, CHUNK = 2048, 8192
"""Vocabulary entries a program reads per loop step, and per program (a row is split over
cdiv(vocab, CHUNK) programs, so 256 rows of Whisper's vocabulary fill the GPU)."""


@triton.jit
def _chunk_kernel(
    Logits,
    stride_row,
    Banned,
    stride_banned,
    PartMax,
    PartSum,
    PartBest,
    PartIdx,
    vocab,
    num_chunks,
    HAS_BANS: tl.constexpr,
    LOGPROBS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One (row, chunk): the largest banned-masked logit and its first index, and with LOGPROBS
    the raw logits' max and sum of exp(x - max)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    logits = Logits + row * stride_row
    # Per-lane running values, reduced once after the loop (a block-wide reduction per loop
    # step would make the kernel latency-bound).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int64) + chunk * CHUNK
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(logits + offs, mask=inside, other=float("-inf")).to(tl.float32)
        if LOGPROBS:
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # padding lanes so far
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
        y = x
        if HAS_BANS:
            banned = tl.load(Banned + row * stride_banned + offs, mask=inside, other=1)
            y = tl.where(banned != 0, float("-inf"), y)
        better = y > best  # strict: a lane keeps its earlier index on a tie
        best_idx = tl.where(better, offs.to(tl.int64), best_idx)
        best = tl.where(better, y, best)
    top = tl.max(best, 0)
    top_idx = tl.min(tl.where(best == top, best_idx, vocab + CHUNK), 0)  # torch's first index
    part = row * num_chunks + chunk
    tl.store(PartBest + part, top)
    tl.store(PartIdx + part, top_idx)
    if LOGPROBS:
        chunk_max = tl.max(run_max, 0)
        safe = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
        tl.store(PartMax + part, chunk_max)
        tl.store(PartSum + part, tl.sum(run_sum * tl.exp(run_max - safe), 0))


@triton.jit
def _combine_kernel(
    Logits,
    stride_row,
    Forced,
    PartMax,
    PartSum,
    PartBest,
    PartIdx,
    Sampled,
    Logprob,
    Rank,
    vocab,
    num_chunks,
    HAS_FORCED: tl.constexpr,
    LOGPROBS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
):
    """One (row, chunk): the row's token from its chunks' bests (largest value, then the first
    index; a forced token wins) and, with LOGPROBS, its raw logprob from the chunks' sums and
    this chunk's count of raw logprobs >= it, added into the row's rank."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    parts = row * num_chunks + tl.arange(0, MAX_CHUNKS)
    used = tl.arange(0, MAX_CHUNKS) < num_chunks
    bests = tl.load(PartBest + parts, mask=used, other=float("-inf"))
    best = tl.max(bests, 0)
    idxs = tl.load(PartIdx + parts, mask=used, other=vocab)
    sampled = tl.min(tl.where(bests == best, idxs, vocab), 0)
    if HAS_FORCED:
        forced = tl.load(Forced + row)
        # A forced row's logits are -inf but 0 at the forced id (argmax 0 past the vocabulary).
        sampled = tl.where(forced >= 0, tl.where(forced < vocab, forced, 0), sampled)
    logits = Logits + row * stride_row
    if LOGPROBS:
        maxes = tl.load(PartMax + parts, mask=used, other=float("-inf"))
        run_max = tl.max(maxes, 0)
        sums = tl.load(PartSum + parts, mask=used, other=0.0)
        log_sum = tl.log(tl.sum(sums * tl.exp(maxes - run_max), 0))
        chosen = (tl.load(logits + sampled).to(tl.float32) - run_max) - log_sum
        count = tl.zeros([BLOCK], tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(logits + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            count += ((x - run_max) - log_sum >= chosen).to(tl.int32)
        tl.atomic_add(Rank + row, tl.sum(count, 0).to(tl.int64))
    if chunk == 0:
        tl.store(Sampled + row, sampled)
        if LOGPROBS:
            tl.store(Logprob + row, chosen)


def greedy_sample(
    logits: torch.Tensor,
    banned: torch.Tensor | None,
    forced: torch.Tensor | None,
    logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(sampled [n] int64, logprob [n, 1] float32, rank [n] int64) of logits [n, vocab], with
    `banned` [n, vocab] bool and `forced` [n] (-1: none); both 2-D inputs with unit stride
    along the vocabulary.

    Each row is split into chunks, one program each: the first kernel finds every chunk's best
    token and log-sum-exp terms, the second combines a row's chunks and counts the rank over
    its chunk (with logprobs the rank pass re-reads the row, from L2). `graphed.dense_sample`
    runs this on CUDA where the step has no Whisper timestamp rules and asks for no top-N
    logprobs (transcription asks only for the sampled token's logprob). Its torch path: a
    float32 copy of the logits, log_softmax, a mask fill per rule, argmax and a rank count,
    each a pass over [rows, vocab] in float32. The rank counts tokens whose raw logprob >=
    the sampled one's."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    device = logits.device
    sampled = torch.empty(rows, dtype=torch.int64, device=device)
    logprob = torch.empty(rows, 1, dtype=torch.float32, device=device) if logprobs else None
    rank = torch.zeros(rows, dtype=torch.int64, device=device) if logprobs else None
    if rows == 0:
        return sampled, logprob, rank
    if banned is not None:
        assert banned.shape == logits.shape and banned.stride(1) == 1
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_best = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int64, device=device)
    part_max = torch.empty_like(part_best) if logprobs else part_best
    part_sum = torch.empty_like(part_best) if logprobs else part_best
    _chunk_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        banned.view(torch.uint8) if banned is not None else logits,
        banned.stride(0) if banned is not None else 0,
        part_max,
        part_sum,
        part_best,
        part_idx,
        vocab,
        num_chunks,
        HAS_BANS=banned is not None,
        LOGPROBS=logprobs,
        BLOCK=BLOCK,
        CHUNK=CHUNK,
        num_warps=8,
    )
    _combine_kernel[(rows, num_chunks if logprobs else 1)](
        logits,
        logits.stride(0),
        forced if forced is not None else sampled,
        part_max,
        part_sum,
        part_best,
        part_idx,
        sampled,
        logprob if logprobs else sampled,
        rank if logprobs else sampled,
        vocab,
        num_chunks,
        HAS_FORCED=forced is not None,
        LOGPROBS=logprobs,
        BLOCK=BLOCK,
        CHUNK=CHUNK,
        MAX_CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=8,
    )
    return sampled, logprob, rank
