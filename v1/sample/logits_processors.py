"""The order of a sampling step's logits rules; each rule lives with its state
(v1/sample/states/) and runs on the whole batch, only on the rows its metadata covers.
Tensors stay on the logits' device; nothing here syncs with the host."""

from __future__ import annotations

import torch

from v1.sample.metadata import RowBitmask, SamplingMetadata
from v1.sample.states.whisper_timestamps import apply_whisper_timestamp_rules

_NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Applies every rule in place to float32 logits [n, vocab] and returns them.

    Order: 1. penalties, then no_repeat_ngram_size; 2. logit_bias, allowed_token_ids,
    suppress_tokens, begin_suppress_tokens, min_tokens; 3. the structured-output grammar mask;
    4. Whisper timestamp rules (their timestamp-vs-text probability test must see every other
    rule, as in transformers); 5. forced tokens override all of the above. Value rules (penalties,
    bias) come before the masks they could otherwise undo; masks (-inf) commute.
    """
    if metadata.penalties is not None:
        metadata.penalties.apply(logits)
    if metadata.token_tables is not None:
        metadata.token_tables.apply(logits)
    if metadata.grammar_bitmask is not None:
        apply_token_bitmask(logits, metadata.grammar_bitmask)
    if metadata.whisper is not None:
        apply_whisper_timestamp_rules(logits, metadata.whisper)
    if metadata.token_tables is not None:
        metadata.token_tables.apply_forced(logits)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, words] int32 packed masks -> [k, vocab_size] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, grammar: RowBitmask) -> None:
    """Tokens outside each listed row's (grammar) mask become impossible."""
    allowed = unpack_bitmask(grammar.bitmask, logits.shape[1])
    logits[grammar.rows] = logits[grammar.rows].masked_fill(~allowed, _NEG_INF)
