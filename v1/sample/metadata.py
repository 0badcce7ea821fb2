"""What the sampler reads for one step: `SamplingMetadata`, built by `SamplingState`: the
sampling parameters, then one part per rule state (v1/sample/states/), each None when no row
of the step uses it. Tensors live on the logits' device, one row per request in batch order
unless a part says otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from v1.sample.states.penalties import PenaltiesMetadata
from v1.sample.states.slots import RowTokenIds
from v1.sample.states.token_tables import RowLogitBias, TokenTablesMetadata
from v1.sample.states.whisper_timestamps import WhisperTimestampMetadata, WhisperTokenInfo

__all__ = [
    "PenaltiesMetadata",
    "RowBitmask",
    "RowLogitBias",
    "RowTokenIds",
    "SamplingMetadata",
    "TokenTablesMetadata",
    "WhisperTimestampMetadata",
    "WhisperTokenInfo",
]


@dataclass
class RowBitmask:
    """A packed allowed-token mask per row (structured outputs), for the rows that have one."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    bitmask: torch.Tensor
    """[k, ceil(vocab / 32)] int32: token t allowed when bit t % 32 of word t // 32 is set."""


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
    processed_logprob_rows: torch.Tensor | None = None
    """[k] int64 rows whose logprobs are "processed" (beam search): the rules run on their
    log_softmax(logits) and the logprobs are what the rules leave, as transformers' beam search
    scores them; None when no row asks for it."""

    penalties: PenaltiesMetadata | None = None
    token_tables: TokenTablesMetadata | None = None
    whisper: WhisperTimestampMetadata | None = None
    grammar_bitmask: RowBitmask | None = None
    """Structured outputs: tokens outside each row's grammar mask get -inf (set by the runner
    from the SchedulerOutput, not by SamplingState)."""
