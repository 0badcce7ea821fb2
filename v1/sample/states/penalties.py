"""Per-slot repetition/frequency/presence penalties and no-repeat-ngram, with the token history
they read. The history (prompt, then outputs) is written on the device from the sampled tensor,
so a step can be built before the previous one's tokens reach the host (pipelined steps)."""

from __future__ import annotations

import numpy as np
import torch

from v1.host_copy import to_device
from v1.sample.metadata import SamplingMetadata
from v1.sample.states.slots import Fill, SlotRequest, StepRows, push_rows
from v1.sampling_params import SamplingParams

_REPETITION, _FREQUENCY, _PRESENCE = range(3)
_NEUTRAL = np.array([1.0, 0.0, 0.0], dtype=np.float32)


class PenaltiesState:
    """Penalties, no-repeat-ngram sizes and the decoder token history of the slots."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.device = device
        self._penalties = np.tile(_NEUTRAL, (max_num_reqs, 1))
        self._penalties_dev = to_device(self._penalties, device)
        self.no_repeat_ngram_size = np.zeros(max_num_reqs, dtype=np.int64)
        """0: off."""
        self.no_repeat_ngram_size_dev = to_device(self.no_repeat_ngram_size, device)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens_dev = to_device(self.num_prompt_tokens, device)
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len), dtype=torch.int32, device=device
        )
        """Decoder sequence (prompt, then outputs) per slot."""
        self._dirty: set[int] = set()

    @staticmethod
    def needs_general_sampler(params: SamplingParams) -> bool:
        return (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or bool(params.no_repeat_ngram_size)
        )

    def add(self, slot: int, request: SlotRequest) -> None:
        params = request.params
        self._penalties[slot] = (
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        self.no_repeat_ngram_size[slot] = params.no_repeat_ngram_size or 0
        self.num_prompt_tokens[slot] = len(request.prompt_token_ids)
        sequence = np.asarray(
            request.prompt_token_ids + list(request.output_token_ids), dtype=np.int32
        )
        if len(sequence):
            self.token_ids[slot, : len(sequence)] = to_device(sequence, self.device)
        self._dirty.add(slot)

    def remove(self, slot: int) -> None:
        self._penalties[slot] = _NEUTRAL
        self.no_repeat_ngram_size[slot] = 0
        self.num_prompt_tokens[slot] = 0
        self._dirty.add(slot)

    def flush(self) -> None:
        if self._dirty:
            push_rows(self._penalties_dev, self._penalties, self._dirty)
            push_rows(self.no_repeat_ngram_size_dev, self.no_repeat_ngram_size, self._dirty)
            push_rows(self.num_prompt_tokens_dev, self.num_prompt_tokens, self._dirty)
            self._dirty.clear()

    def append(self, idx: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """token_ids[idx, positions] = tokens, on the device in stream order."""
        self.token_ids[idx, positions] = tokens.to(torch.int32)

    def stage(self, step: StepRows) -> Fill | None:
        slots = step.slots
        penalties = self._penalties[slots]
        use_penalties = (
            (penalties[:, _REPETITION] != 1.0)
            | (penalties[:, _FREQUENCY] != 0.0)
            | (penalties[:, _PRESENCE] != 0.0)
        )
        ngram = self.no_repeat_ngram_size[slots]
        needs_history = use_penalties | (ngram > 0)
        if not bool(needs_history.any()):
            return None
        step.stage("penalties.num_output_tokens", step.num_output_tokens)
        # Rows that read no history may be cut short: only rows in needs_history use it.
        lengths = step.num_prompt_tokens + step.num_output_tokens
        width = int(lengths[needs_history].max())

        def fill(metadata: SamplingMetadata) -> None:
            idx = step.idx
            metadata.token_ids = self.token_ids[idx, :width].long()
            metadata.num_prompt_tokens = self.num_prompt_tokens_dev[idx]
            metadata.num_output_tokens = step["penalties.num_output_tokens"]
            if bool(use_penalties.any()):
                penalties_dev = self._penalties_dev[idx]
                metadata.no_penalties = False
                metadata.repetition_penalties = penalties_dev[:, _REPETITION]
                metadata.frequency_penalties = penalties_dev[:, _FREQUENCY]
                metadata.presence_penalties = penalties_dev[:, _PRESENCE]
            if bool((ngram > 0).any()):
                metadata.no_repeat_ngram_size = self.no_repeat_ngram_size_dev[idx]
                metadata.max_no_repeat_ngram_size = int(ngram.max())

        return fill
