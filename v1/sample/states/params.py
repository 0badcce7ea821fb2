"""Per-slot sampling parameters: temperature, top-k/top-p/min-p, seeds and their generators,
logprobs asked. Floats live in one device table with named column views (one copy per flush);
a seeded request's draw depends only on its seed and output index (`step_seed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from v1.host_copy import to_device
from v1.sample.states.slots import SlotRequest, StepRows, push_rows
from v1.sampling_params import SamplingParams

GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1
_TEMPERATURE, _TOP_P, _MIN_P = range(3)
_NEUTRAL = np.array([1.0, 1.0, 0.0], dtype=np.float32)
_NEG_INF = float("-inf")


@dataclass
class ParamsMetadata:
    """A step's sampling parameters; rows follow the logits' rows."""

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

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of the processed float32 `logits` [n, vocab] (scaled in place):
        argmax for greedy rows; temperature, top-k, top-p, min-p, then one exponential race
        per random row (a seeded row draws its noise from its own generator)."""
        greedy = None
        if not self.all_random:
            greedy = logits.argmax(dim=-1)
            if self.all_greedy:
                return greedy
        is_greedy = self.temperature < GREEDY_EPS
        temperature = torch.where(is_greedy, 1.0, self.temperature)
        logits.div_(temperature.unsqueeze(1))
        if self.top_k is not None or self.top_p is not None:
            logits = apply_top_k_top_p(logits, self.top_k, self.top_p)
        if self.min_p is not None:
            logits = apply_min_p(logits, self.min_p)
        random = random_sample(logits.softmax(dim=-1), self)
        if greedy is None:
            return random
        return torch.where(is_greedy, greedy, random)


def step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): the seed of a seeded request's draw at output index `step`.

    Reseeding per step makes a request's noise a function of its seed and step only: the same
    whatever the batch, and the same again after preemption and resume.
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value


class ParamsState:
    """Temperature, top-k, top-p, min-p, seeds and logprob counts of the requests in the slots."""

    def __init__(self, max_num_reqs: int, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        """Shared stream of the random rows without a seed."""
        self.generator.manual_seed(seed)
        self._floats = np.tile(_NEUTRAL, (max_num_reqs, 1))
        self._floats_dev = to_device(self._floats, device)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        """0: off."""
        self.top_k_dev = to_device(self.top_k, device)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no logprobs."""
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        """-1: no prompt logprobs (the runner computes them; the sampler does not)."""
        self.processed_logprobs = np.zeros(max_num_reqs, dtype=bool)
        """logprobs_mode "processed": logprobs are the rules' output on log_softmax(logits)."""
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.seeds: dict[int, int] = {}
        self.generators: dict[int, torch.Generator] = {}
        self._dirty: set[int] = set()

    # Named views of the float table (host [n] and device [n]).
    @property
    def temperature(self) -> np.ndarray:
        return self._floats[:, _TEMPERATURE]

    @property
    def top_p(self) -> np.ndarray:
        return self._floats[:, _TOP_P]

    @property
    def min_p(self) -> np.ndarray:
        return self._floats[:, _MIN_P]

    @staticmethod
    def needs_general_sampler(params: SamplingParams) -> bool:
        """Random sampling and processed logprobs are not in the fixed-shape sampler."""
        return params.temperature >= GREEDY_EPS or params.logprobs_mode == "processed"

    def add(self, slot: int, request: SlotRequest) -> None:
        params = request.params
        self._floats[slot] = (params.temperature, params.top_p, params.min_p)
        self.top_k[slot] = max(params.top_k, 0)
        self.num_logprobs[slot] = _or_minus_one(params.logprobs)
        self.num_prompt_logprobs[slot] = _or_minus_one(params.prompt_logprobs)
        self.processed_logprobs[slot] = params.logprobs_mode == "processed"
        if params.seed is not None:
            self.seeded[slot] = True
            self.seeds[slot] = params.seed
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed & _MASK64)
            self.generators[slot] = generator
        self._dirty.add(slot)

    def remove(self, slot: int) -> None:
        self._floats[slot] = _NEUTRAL
        self.top_k[slot] = 0
        self.num_logprobs[slot] = -1
        self.num_prompt_logprobs[slot] = -1
        self.processed_logprobs[slot] = False
        self.seeded[slot] = False
        self.seeds.pop(slot, None)
        self.generators.pop(slot, None)
        self._dirty.add(slot)

    def flush(self) -> None:
        if self._dirty:
            push_rows(self._floats_dev, self._floats, self._dirty)
            push_rows(self.top_k_dev, self.top_k, self._dirty)
            self._dirty.clear()

    def stage(self, step: StepRows) -> None:
        processed = np.flatnonzero(self.processed_logprobs[step.slots])
        if len(processed):
            step.stage("params.processed_rows", processed)

    def metadata(self, step: StepRows) -> ParamsMetadata:
        """The step's parameters (after `stage` and the step's ship)."""
        slots = step.slots
        floats = self._floats[slots]
        is_greedy = floats[:, _TEMPERATURE] < GREEDY_EPS
        is_random = ~is_greedy
        num_logprobs = self.num_logprobs[slots]
        max_num_logprobs = int(num_logprobs.max()) if len(slots) else -1
        floats_dev = self._floats_dev[step.idx]  # [n, 3]
        use_top_k = bool((is_random & (self.top_k[slots] > 0)).any())
        use_top_p = bool((is_random & (floats[:, _TOP_P] < 1.0)).any())
        use_min_p = bool((is_random & (floats[:, _MIN_P] > 0.0)).any())
        metadata = ParamsMetadata(
            temperature=floats_dev[:, _TEMPERATURE],
            all_greedy=bool(is_greedy.all()),
            all_random=bool(is_random.all()),
            top_k=self.top_k_dev[step.idx] if use_top_k else None,
            top_p=floats_dev[:, _TOP_P] if use_top_p else None,
            min_p=floats_dev[:, _MIN_P] if use_min_p else None,
            generator=self.generator,
            generators=self._position_generators(step, is_random),
            max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
        )
        if bool(self.processed_logprobs[slots].any()):
            metadata.processed_logprob_rows = step["params.processed_rows"]
        return metadata

    def _position_generators(
        self, step: StepRows, is_random: np.ndarray
    ) -> dict[int, torch.Generator]:
        """Seeds each seeded random row's generator for the output index it samples now."""
        generators = {}
        if not self.seeds:
            return generators
        rows = np.flatnonzero(is_random & self.seeded[step.slots])
        for row, slot, step_index in zip(
            rows.tolist(),
            step.slots[rows].tolist(),
            step.num_output_tokens[rows].tolist(),
            strict=True,
        ):
            generator = self.generators[slot]
            generator.manual_seed(step_seed(self.seeds[slot], step_index))
            generators[row] = generator
        return generators


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks (in place) all but the top-k logits, then all outside the top-p nucleus.

    top_k <= 0 or >= vocab disables it for a row (ties with the k-th value are kept); top_p = 1
    disables it; the most likely token always stays. Same results as transformers' warpers.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [n, vocab] ascending
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [n, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_value, _NEG_INF)
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cum_probs <= 1 - top_p.unsqueeze(1)
        outside[:, -1] = False
        sorted_logits.masked_fill_(outside, _NEG_INF)
    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks (in place) tokens whose probability is below min_p times the top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def random_sample(probs: torch.Tensor, metadata: ParamsMetadata) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) per entry: an exact draw from each row's distribution.

    Unseeded rows share one generator; each seeded row refills its own row of noise from its own
    generator (the one per-request loop of the step, as in vLLM).
    """
    noise = torch.empty_like(probs)
    if len(metadata.generators) < probs.shape[0]:
        noise.exponential_(generator=metadata.generator)
    for row, generator in metadata.generators.items():
        noise[row].exponential_(generator=generator)
    # Exp(1) can round to 0; a tiny floor keeps 0 / 0 out of the argmax.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)
