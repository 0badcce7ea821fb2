"""What the sampler reads for one step: `SamplingMetadata`, built by `SamplingState`: the
sampling parameters, then one part per rule state (v1/sample/states/), each None when no row
of the step uses it. Tensors live on the logits' device, one row per request in batch order
unless a part says otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.sample.states.params import ParamsMetadata
from v1.sample.states.penalties import PenaltiesMetadata
from v1.sample.states.token_tables import TokenTablesMetadata
from v1.sample.states.whisper_timestamps import WhisperTimestampMetadata


@dataclass
class RowBitmask:
    """A packed allowed-token mask per row (structured outputs), for the rows that have one."""

    rows: torch.Tensor
    """[k] int64 batch row indices."""
    bitmask: torch.Tensor
    """[k, ceil(vocab / 32)] int32: token t allowed when bit t % 32 of word t // 32 is set."""


@dataclass
class SamplingMetadata:
    """One sampler call: the parameters' part and one part per rule state (None when no row of
    the step uses that state's rules); rows follow the logits' rows."""

    num_reqs: int
    params: ParamsMetadata
    penalties: PenaltiesMetadata | None = None
    token_tables: TokenTablesMetadata | None = None
    whisper: WhisperTimestampMetadata | None = None
    grammar_bitmask: RowBitmask | None = None
    """Structured outputs: tokens outside each row's grammar mask get -inf (set by the runner
    from the SchedulerOutput, not by SamplingState)."""
