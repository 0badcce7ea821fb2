"""The Sampler: logits of one step -> one token per request (+ logprobs), batched on device.
It runs the rule states' metadata parts in one fixed order (`apply_logits_processors`), then
samples with the parameters' part (states/params.py); a seeded row's tokens do not depend on
the rest of the batch. Nothing here syncs with the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.sample.metadata import RowBitmask, SamplingMetadata
from v1.sample.states.token_tables import apply_forced_tokens
from v1.sample.states.whisper_timestamps import apply_whisper_timestamp_rules

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[n] int64."""
    logprob_token_ids: torch.Tensor | None = None
    """[n, 1 + max_num_logprobs] int64: the sampled token, then the top-N tokens."""
    logprobs: torch.Tensor | None = None
    """[n, 1 + max_num_logprobs] float32, log_softmax of the raw model logits (processed rows:
    the rules' output on log_softmax of the logits)."""
    ranks: torch.Tensor | None = None
    """[n] int64: 1-based rank of the sampled token among the raw logprobs."""


class Sampler(torch.nn.Module):
    """Stateless; all per-request state comes in `SamplingMetadata`.

    Logprobs are "raw logprobs" (vLLM's default): log_softmax of the model's logits before any
    rule, penalty or temperature, so they describe the model, not the sampling distribution.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # float32 copy: the rules work in place and the caller's logits stay untouched.
        logits = logits.to(torch.float32, copy=True)  # [n, vocab]
        raw_logprobs = None
        if metadata.params.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed_rows = metadata.params.processed_logprob_rows
        if processed_rows is not None:
            # The rules run on log-probabilities for these rows (transformers' beam search
            # order); sampling is unchanged: every rule but the repetition penalty is invariant
            # to a per-row shift, and so are the temperature softmax and the argmax.
            logits[processed_rows] = torch.log_softmax(logits[processed_rows], dim=-1)
        logits = apply_logits_processors(logits, metadata)
        if processed_rows is not None and raw_logprobs is not None:
            raw_logprobs[processed_rows] = logits[processed_rows]  # before sampling scales them
        sampled = metadata.params.sample(logits)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        assert metadata.params.max_num_logprobs is not None
        token_ids, logprobs, ranks = gather_logprobs(
            raw_logprobs, metadata.params.max_num_logprobs, sampled
        )
        return SamplerOutput(sampled, token_ids, logprobs, ranks)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's logprob and the top-N ones: ids, logprobs [n, 1+N] and ranks [n].

    Rank = number of tokens with a logprob >= the sampled one's (vLLM's rule, 1 for the argmax).
    """
    sampled = sampled.unsqueeze(1)  # [n, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [n, 1]
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)
    if num_logprobs == 0:  # the sampled token's only (transcription windows): no top-k pass
        return sampled, sampled_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = torch.cat([sampled, top_ids], dim=1)
    values = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return token_ids, values, ranks


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Applies every rule in place to float32 logits [n, vocab] and returns them.

    Order: 1. penalties, then no_repeat_ngram_size; 2. logit_bias, allowed_token_ids,
    suppress_tokens, begin_suppress_tokens, min_tokens; 3. the structured-output grammar mask;
    4. Whisper timestamp rules (their timestamp-vs-text probability test must see every other
    rule, as in transformers); 5. forced tokens override all of the above, except the grammar:
    on a grammar row a forced token the grammar does not allow (BART's forced BOS / EOS) is not
    forced, so a structured output is never broken by a generation-config rule. Value rules
    (penalties, bias) come before the masks they could otherwise undo; masks (-inf) commute.
    """
    if metadata.penalties is not None:
        metadata.penalties.apply(logits)
    if metadata.token_tables is not None:
        metadata.token_tables.apply(logits)
    allowed = None
    if metadata.grammar_bitmask is not None:
        allowed = apply_token_bitmask(logits, metadata.grammar_bitmask)
    if metadata.whisper is not None:
        apply_whisper_timestamp_rules(logits, metadata.whisper)
    forced = metadata.token_tables.forced_token_ids if metadata.token_tables else None
    if forced is not None:
        if allowed is not None:
            assert metadata.grammar_bitmask is not None
            forced = forced_within_grammar(forced, metadata.grammar_bitmask.rows, allowed)
        apply_forced_tokens(logits, forced)
    return logits


def forced_within_grammar(
    forced: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """`forced` [n] (-1: none) with the forced tokens of the grammar `rows` that their grammar
    mask `allowed` [k, vocab] forbids dropped (-1): the grammar wins over forced tokens."""
    on_rows = forced[rows]
    ok = allowed.gather(1, on_rows.clamp(min=0).unsqueeze(1)).squeeze(1)
    forced = forced.clone()
    forced[rows] = torch.where(ok, on_rows, torch.full_like(on_rows, -1))
    return forced


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, words] int32 packed masks -> [k, vocab_size] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, grammar: RowBitmask) -> torch.Tensor:
    """Tokens outside each listed row's (grammar) mask become impossible; returns the unpacked
    mask [k, vocab] bool."""
    allowed = unpack_bitmask(grammar.bitmask, logits.shape[1])
    logits[grammar.rows] = logits[grammar.rows].masked_fill(~allowed, _NEG_INF)
    return allowed
