"""The Sampler: logits of one step -> one token per request (+ logprobs), batched on device.

Order: logits rules (`apply_logits_processors`) -> greedy rows take the argmax; random rows get
temperature, top-k, top-p, min-p, then one exponential race per row (a seeded row draws its noise
from its own generator, so its tokens do not depend on the rest of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1.sample.logits_processors import apply_logits_processors
from v1.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5
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
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed_rows = metadata.processed_logprob_rows
        if processed_rows is not None:
            # The rules run on log-probabilities for these rows (transformers' beam search
            # order); sampling is unchanged: every rule but the repetition penalty is invariant
            # to a per-row shift, and so are the temperature softmax and the argmax.
            logits[processed_rows] = torch.log_softmax(logits[processed_rows], dim=-1)
        logits = apply_logits_processors(logits, metadata)
        if processed_rows is not None and raw_logprobs is not None:
            raw_logprobs[processed_rows] = logits[processed_rows]  # before sampling scales them
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        assert metadata.max_num_logprobs is not None
        token_ids, logprobs, ranks = gather_logprobs(
            raw_logprobs, metadata.max_num_logprobs, sampled
        )
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy
        is_greedy = metadata.temperature < _GREEDY_EPS
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits.div_(temperature.unsqueeze(1))
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        random = random_sample(logits.softmax(dim=-1), metadata)
        if greedy is None:
            return random
        return torch.where(is_greedy, greedy, random)


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


def random_sample(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
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
