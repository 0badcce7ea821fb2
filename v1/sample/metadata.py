"""What the sampler needs for one step: `SamplingMetadata`, built by `SamplingState`.

Every tensor lives on the logits' device and has one row per request of the step, in batch order,
unless it says otherwise (`RowTokenIds` cover only the rows a rule is active for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class WhisperTokenInfo:
    """The special token ids Whisper's timestamp rules need (from the model's generation config)."""

    eos_token_id: int
    """<|endoftext|>; the text tokens are the ids below it."""
    no_timestamps_token_id: int
    """<|notimestamps|>; never generated while timestamps are on."""
    timestamp_begin: int
    """<|0.00|>; every id from here up is a timestamp."""
    max_initial_timestamp_index: int | None = 50
    """The first timestamp is at most timestamp_begin + this (None: no limit)."""


@dataclass
class RowTokenIds:
    """A token id list per row, for the rows of the batch one rule is active for."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    token_ids: torch.Tensor
    """[k, width] int64, padded with -1."""


@dataclass
class RowLogitBias:
    """A sparse additive bias per row, for the rows of the batch that have one."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    token_ids: torch.Tensor
    """[k, width] int64, padded with -1."""
    biases: torch.Tensor
    """[k, width] float32, the bias of each token id (0 in padding)."""


@dataclass
class RowBitmask:
    """A packed allowed-token mask per row (structured outputs), for the rows that have one."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    bitmask: torch.Tensor
    """[k, ceil(vocab / 32)] int32: token t allowed when bit t % 32 of word t // 32 is set."""


@dataclass
class WhisperTimestampMetadata:
    """Per-row state of Whisper's timestamp rules, derived on the host from the outputs so far."""

    info: WhisperTokenInfo
    rows: torch.Tensor
    """[k] int64 batch rows with whisper_timestamps on."""
    is_first: torch.Tensor
    """[k] bool: no output token yet (the first token must be an early timestamp)."""
    block_timestamps: torch.Tensor
    """[k] bool: the last two outputs were timestamps (or one timestamp only): text must follow."""
    block_text: torch.Tensor
    """[k] bool: a single timestamp ends the outputs: its pair (or EOS) must follow."""
    min_timestamp: torch.Tensor
    """[k] int64: the smallest timestamp id allowed (timestamps never decrease)."""


@dataclass
class SamplingMetadata:
    """Device tensors and host flags for one sampler call; rows follow the logits' rows."""

    num_reqs: int
    temperature: torch.Tensor
    """[n] float32; rows below 1e-5 are greedy."""
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    """[n] int64, 0 disables; None when no random row uses top-k."""
    top_p: torch.Tensor | None
    """[n] float32; None when no random row uses top-p."""
    min_p: torch.Tensor | None
    """[n] float32; None when no random row uses min-p."""
    generator: torch.Generator
    """Shared stream for the random rows without a seed."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row -> that request's own generator, already positioned for this step's draw."""
    max_num_logprobs: int | None = None
    """Largest `logprobs` of the batch; None when no request asks for logprobs."""

    no_penalties: bool = True
    repetition_penalties: torch.Tensor | None = None
    """[n] float32 (1.0 = off)."""
    frequency_penalties: torch.Tensor | None = None
    """[n] float32 (0.0 = off)."""
    presence_penalties: torch.Tensor | None = None
    """[n] float32 (0.0 = off)."""

    token_ids: torch.Tensor | None = None
    """[n, L] int64 decoder sequence (prompt then outputs); set when penalties or no-repeat-ngram
    are used. Only the first num_prompt_tokens + num_output_tokens entries of a row are valid."""
    num_prompt_tokens: torch.Tensor | None = None
    """[n] int64, set with token_ids."""
    num_output_tokens: torch.Tensor | None = None
    """[n] int64, set with token_ids."""
    no_repeat_ngram_size: torch.Tensor | None = None
    """[n] int64 (0 = off); None when no row uses it."""
    max_no_repeat_ngram_size: int = 0

    allowed_token_ids: RowTokenIds | None = None
    suppress_token_ids: RowTokenIds | None = None
    begin_suppress_token_ids: RowTokenIds | None = None
    """Only rows about to sample their first output token."""
    min_tokens_stop_ids: RowTokenIds | None = None
    """EOS (unless ignore_eos) and stop_token_ids, only for rows still under min_tokens."""
    logit_bias: RowLogitBias | None = None
    """Added to the logits after the penalties (OpenAI's logit_bias)."""
    grammar_bitmask: RowBitmask | None = None
    """Structured outputs: tokens outside each row's grammar mask get -inf (set by the runner
    from the SchedulerOutput, not by SamplingState)."""
    forced_token_ids: torch.Tensor | None = None
    """[n] int64: the only token allowed at this step, -1 for none (forced_token_ids and
    forced_eos_token_id merged; EOS wins when both apply, as in transformers)."""
    whisper: WhisperTimestampMetadata | None = None
    processed_logprob_rows: torch.Tensor | None = None
    """[k] int64 rows whose logprobs are "processed" (beam search): the rules run on their
    log_softmax(logits) and the logprobs are what the rules leave, as transformers' beam search
    scores them; None when no row asks for it."""
