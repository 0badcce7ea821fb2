"""Batched logits rules of a sampling step (penalties, masks, Whisper timestamps, forced tokens).

`apply_logits_processors` runs them in a fixed order (see there); each rule is one function over
the whole batch, active only on the rows `SamplingMetadata` enables it for. Tensors stay on the
logits' device; nothing here syncs with the host.
"""

from __future__ import annotations

import torch

from v1.sample.metadata import (
    RowBitmask,
    RowLogitBias,
    RowTokenIds,
    SamplingMetadata,
    WhisperTimestampMetadata,
)

_NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Applies every rule in place to float32 logits [n, vocab] and returns them.

    Order: 1. repetition/frequency/presence penalties, then logit_bias (they only move values,
    so every later mask is final); 2. allowed_token_ids and the structured-output grammar mask;
    3. suppress_tokens; 4. begin_suppress_tokens; 5. min_tokens; 6. no_repeat_ngram_size;
    7. Whisper timestamp rules (last among the masks: their timestamp-vs-text probability test
    must see every other mask, as in transformers); 8. forced tokens (forced_token_ids,
    forced_eos_token_id) override all of the above.
    """
    if not metadata.no_penalties:
        apply_penalties(logits, metadata)
    if metadata.logit_bias is not None:
        apply_logit_bias(logits, metadata.logit_bias)
    if metadata.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, metadata.allowed_token_ids)
    if metadata.grammar_bitmask is not None:
        apply_token_bitmask(logits, metadata.grammar_bitmask)
    for banned in (
        metadata.suppress_token_ids,
        metadata.begin_suppress_token_ids,
        metadata.min_tokens_stop_ids,
    ):
        if banned is not None:
            apply_banned_token_ids(logits, banned)
    if metadata.no_repeat_ngram_size is not None:
        apply_no_repeat_ngram(logits, metadata)
    if metadata.whisper is not None:
        apply_whisper_timestamp_rules(logits, metadata.whisper)
    if metadata.forced_token_ids is not None:
        apply_forced_tokens(logits, metadata.forced_token_ids)
    return logits


def token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, width] ids (-1 padding) -> [k, vocab] bool; ids outside the vocabulary are dropped."""
    spare = torch.where((token_ids < 0) | (token_ids >= vocab_size), vocab_size, token_ids)
    mask = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device
    )
    mask.scatter_(1, spare, True)
    return mask[:, :vocab_size]


def apply_allowed_token_ids(logits: torch.Tensor, allowed: RowTokenIds) -> None:
    """Only the listed tokens stay possible on the listed rows."""
    disallowed = ~token_mask(allowed.token_ids, logits.shape[1])
    logits[allowed.rows] = logits[allowed.rows].masked_fill(disallowed, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, bias: RowLogitBias) -> None:
    """Adds each listed row's sparse bias to its logits (padding ids -1 go to a spare column)."""
    vocab_size = logits.shape[1]
    ids = torch.where(
        (bias.token_ids < 0) | (bias.token_ids >= vocab_size), vocab_size, bias.token_ids
    )
    dense = torch.zeros(ids.shape[0], vocab_size + 1, dtype=logits.dtype, device=logits.device)
    dense.scatter_add_(1, ids, bias.biases.to(logits.dtype))
    logits[bias.rows] += dense[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, words] int32 packed masks -> [k, vocab_size] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, grammar: RowBitmask) -> None:
    """Tokens outside each listed row's (grammar) mask become impossible."""
    allowed = unpack_bitmask(grammar.bitmask, logits.shape[1])
    logits[grammar.rows] = logits[grammar.rows].masked_fill(~allowed, _NEG_INF)


def apply_banned_token_ids(logits: torch.Tensor, banned: RowTokenIds) -> None:
    """The listed tokens become impossible on the listed rows."""
    mask = token_mask(banned.token_ids, logits.shape[1])
    logits[banned.rows] = logits[banned.rows].masked_fill(mask, _NEG_INF)


def get_token_bin_counts_and_mask(
    token_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token counts [n, vocab] (float32) and presence mask of the `valid` positions."""
    ids = torch.where(valid & (token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]
    return counts, counts > 0


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """vLLM semantics: repetition over prompt + output tokens, frequency/presence over outputs."""
    token_ids = metadata.token_ids
    assert token_ids is not None and metadata.num_prompt_tokens is not None
    assert metadata.num_output_tokens is not None and metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    vocab_size = logits.shape[1]
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)  # [L]
    num_prompt = metadata.num_prompt_tokens.unsqueeze(1)
    num_total = num_prompt + metadata.num_output_tokens.unsqueeze(1)
    _, prompt_mask = get_token_bin_counts_and_mask(token_ids, positions < num_prompt, vocab_size)
    output_counts, output_mask = get_token_bin_counts_and_mask(
        token_ids, (positions >= num_prompt) & (positions < num_total), vocab_size
    )
    repetition = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)
    repetition = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * output_mask


def apply_no_repeat_ngram(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """transformers' NoRepeatNGramLogitsProcessor over each row's decoder sequence.

    With sizes n per row and sequence s of length len: s[t] is banned when t >= n-1 and
    s[t-n+1 : t] equals the last n-1 tokens s[len-n+1 : len]. We grow the match backwards one
    offset at a time (a loop over ngram length, not over requests).
    """
    sizes = metadata.no_repeat_ngram_size
    token_ids = metadata.token_ids
    assert sizes is not None and token_ids is not None
    assert metadata.num_prompt_tokens is not None and metadata.num_output_tokens is not None
    lengths = (metadata.num_prompt_tokens + metadata.num_output_tokens).unsqueeze(1)  # [n, 1]
    sizes = sizes.unsqueeze(1)  # [n, 1]
    num_positions = token_ids.shape[1]
    t = torch.arange(num_positions, device=token_ids.device).unsqueeze(0)  # [1, L]
    banned = (sizes > 0) & (t >= sizes - 1) & (t < lengths)  # [n, L]
    for d in range(metadata.max_no_repeat_ngram_size - 1):
        # Compare s[t-1-d] with s[len-1-d], needed only while d < n-1.
        shifted = torch.nn.functional.pad(token_ids, (1 + d, 0), value=-1)[:, :num_positions]
        # Rows without the rule may be longer than the shipped history: clamp keeps them in.
        last = (lengths - 1 - d).clamp(min=0, max=num_positions - 1)
        suffix = token_ids.gather(1, last)  # [n, 1]
        banned &= (shifted == suffix) | (d >= sizes - 1)
    vocab_size = logits.shape[1]
    ids = torch.where(banned & (token_ids < vocab_size), token_ids, vocab_size)
    mask = torch.zeros(logits.shape[0], vocab_size + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, ids, True)
    logits.masked_fill_(mask[:, :vocab_size], _NEG_INF)


def apply_whisper_timestamp_rules(logits: torch.Tensor, whisper: WhisperTimestampMetadata) -> None:
    """transformers' WhisperTimeStampLogitsProcessor on the rows with timestamps on.

    <|notimestamps|> is never generated; timestamps come in pairs (after a lone timestamp only a
    timestamp or a special token >= EOS, after a pair only non-timestamps) and never decrease;
    the first output is a timestamp <= timestamp_begin + max_initial_timestamp_index; when the
    timestamps' total probability beats every text token, a timestamp is forced.
    """
    scores = logits[whisper.rows]  # [k, vocab]
    whisper_timestamp_rules_(scores, whisper)
    logits[whisper.rows] = scores


def whisper_timestamp_rules_(
    scores: torch.Tensor, whisper: WhisperTimestampMetadata, active: torch.Tensor | None = None
) -> None:
    """The timestamp rules in place on `scores` [k, vocab], whose rows are `whisper`'s rows;
    `active` [k] bool (None: all) leaves the other rows untouched (the fixed-shape sampler
    applies the rules to every row of a step and enables them per row)."""
    info = whisper.info
    tb = info.timestamp_begin
    vocab_ids = torch.arange(scores.shape[1], device=scores.device)
    is_timestamp = vocab_ids >= tb  # [vocab]
    mask = vocab_ids == info.no_timestamps_token_id
    mask = mask | (whisper.block_timestamps.unsqueeze(1) & is_timestamp)
    mask = mask | (whisper.block_text.unsqueeze(1) & (vocab_ids < info.eos_token_id))
    mask = mask | (is_timestamp & (vocab_ids < whisper.min_timestamp.unsqueeze(1)))
    first_banned = ~is_timestamp
    if info.max_initial_timestamp_index is not None:
        first_banned = first_banned | (vocab_ids > tb + info.max_initial_timestamp_index)
    mask = mask | (whisper.is_first.unsqueeze(1) & first_banned)
    if active is not None:
        mask = mask & active.unsqueeze(1)
    scores.masked_fill_(mask, _NEG_INF)

    logprobs = torch.log_softmax(scores, dim=-1)
    timestamp_logprob = logprobs[:, tb:].logsumexp(dim=-1)
    max_text_logprob = logprobs[:, :tb].max(dim=-1).values
    force_timestamp = timestamp_logprob > max_text_logprob
    if active is not None:
        force_timestamp = force_timestamp & active
    scores[:, :tb].masked_fill_(force_timestamp.unsqueeze(1), _NEG_INF)


def apply_forced_tokens(logits: torch.Tensor, forced_token_ids: torch.Tensor) -> None:
    """Rows with a forced token (>= 0) get 0 there and -inf elsewhere (as transformers)."""
    forced = forced_token_ids.unsqueeze(1)  # [n, 1]
    vocab_ids = torch.arange(logits.shape[1], device=logits.device)
    is_forced_row = forced >= 0
    logits.masked_fill_(is_forced_row & (vocab_ids != forced), _NEG_INF)
    logits.masked_fill_(is_forced_row & (vocab_ids == forced), 0.0)
