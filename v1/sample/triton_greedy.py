"""Greedy sampling of a step's logits in one Triton kernel: bans, forced tokens, argmax and the
sampled token's raw logprob and rank, reading each row of 16-bit logits once (twice with
logprobs: the rank pass re-reads the row from L2).

`graphed.dense_sample` runs it on CUDA where the step has no Whisper timestamp rules and asks
for no top-N logprobs (transcription asks only for the sampled token's logprob). Its torch path
is the reference: a float32 copy of the logits, log_softmax, a mask fill per rule, argmax and a
rank count, each a pass over [rows, vocab] in float32 (about 0.3 ms a step at 256 rows of
Whisper's 51,866 tokens on an H100).

The results are the torch path's: the same argmax (first index of the largest value), the same
rank rule (tokens whose raw logprob >= the sampled one's), the logprob equal up to the order of
the log-sum-exp's float32 additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
"""Vocabulary entries a program reads per loop step."""


@triton.jit
def _greedy_kernel(
    Logits,
    stride_row,
    Banned,
    stride_banned,
    Forced,
    Sampled,
    Logprob,
    Rank,
    vocab,
    HAS_BANS: tl.constexpr,
    HAS_FORCED: tl.constexpr,
    LOGPROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: argmax of the banned / forced logits and, with LOGPROBS, the raw
    log-sum-exp, then the sampled token's raw logprob and rank."""
    row = tl.program_id(0).to(tl.int64)
    logits = Logits + row * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(logits + offs, mask=inside, other=float("-inf")).to(tl.float32)
        if LOGPROBS:  # online log-sum-exp of the raw logits
            new_max = tl.maximum(run_max, tl.max(x, 0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            run_max = new_max
        y = x
        if HAS_BANS:
            banned = tl.load(Banned + row * stride_banned + offs, mask=inside, other=1)
            y = tl.where(banned != 0, float("-inf"), y)
        block_best = tl.max(y, 0)
        block_idx = tl.argmax(y, 0)  # first index of the block's largest value
        if block_best > best:  # strict: an earlier block keeps a tie (torch's first index)
            best = block_best
            best_idx = start + block_idx.to(tl.int64)
    if HAS_FORCED:
        forced = tl.load(Forced + row)
        # A forced row's logits are -inf but 0 at the forced id (argmax 0 past the vocabulary).
        best_idx = tl.where(forced >= 0, tl.where(forced < vocab, forced, 0), best_idx)
    tl.store(Sampled + row, best_idx)
    if LOGPROBS:
        log_sum = tl.log(run_sum)
        chosen = (tl.load(logits + best_idx).to(tl.float32) - run_max) - log_sum
        count = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            x = tl.load(logits + offs, mask=inside, other=float("-inf")).to(tl.float32)
            count += tl.sum(((x - run_max) - log_sum >= chosen).to(tl.int64), 0)
        tl.store(Logprob + row, chosen)
        tl.store(Rank + row, count)


def greedy_sample(
    logits: torch.Tensor,
    banned: torch.Tensor | None,
    forced: torch.Tensor | None,
    logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(sampled [n] int64, logprob [n, 1] float32, rank [n] int64) of logits [n, vocab], with
    `banned` [n, vocab] bool and `forced` [n] (-1: none); both 2-D inputs with unit stride
    along the vocabulary."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    sampled = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(rows, 1, dtype=torch.float32, device=logits.device) if logprobs else None
    rank = torch.empty(rows, dtype=torch.int64, device=logits.device) if logprobs else None
    if rows == 0:
        return sampled, logprob, rank
    if banned is not None:
        assert banned.shape == logits.shape and banned.stride(1) == 1
    _greedy_kernel[(rows,)](
        logits,
        logits.stride(0),
        banned.view(torch.uint8) if banned is not None else sampled,
        banned.stride(0) if banned is not None else 0,
        forced if forced is not None else sampled,
        sampled,
        logprob if logprobs else sampled,
        rank if logprobs else sampled,
        vocab,
        HAS_BANS=banned is not None,
        HAS_FORCED=forced is not None,
        LOGPROBS=logprobs,
        BLOCK=BLOCK,
        num_warps=8,
    )
    return sampled, logprob, rank
