"""Sampler: greedy, top-k/top-p/min-p against per-row references, the sampled distribution,
seeded reproducibility independent of the batch, and raw logprobs with ranks."""

from __future__ import annotations

import math
import random

import pytest
import torch
from sample_factories import VOCAB_SIZE, Req, make_state

from v1.sample import Sampler, SamplingState
from v1.sample.states.params import apply_min_p, apply_top_k_top_p
from v1.sampling_params import SamplingParams


def random_logits(num_reqs: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_equals_argmax() -> None:
    reqs = [Req(params=SamplingParams(temperature=0.0, top_k=3, seed=i)) for i in range(5)]
    _, metadata = make_state(reqs)
    assert metadata.params.all_greedy
    logits = random_logits(5)
    original = logits.clone()
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None
    assert torch.equal(logits, original)  # the caller's logits are untouched


def test_mixed_batch_greedy_rows_take_argmax_of_processed_logits() -> None:
    logits = random_logits(3)
    best = int(logits[0].argmax())
    reqs = [
        Req(params=SamplingParams(temperature=0.0, suppress_tokens=[best])),
        Req(params=SamplingParams(temperature=1.0)),
        Req(params=SamplingParams(temperature=1e-6)),  # below 1e-5: greedy
    ]
    _, metadata = make_state(reqs)
    assert not metadata.params.all_greedy and not metadata.params.all_random
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[0] == logits[0].topk(2).indices[1]
    assert out.sampled_token_ids[2] == logits[2].argmax()


def reference_filter(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens kept by top-k, then top-p, then min-p, computed one row at a time."""
    vocab = range(len(row))
    kept = set(vocab)
    if 0 < top_k < len(row):
        kth = sorted(row, reverse=True)[top_k - 1]
        kept = {v for v in kept if row[v] >= kth}

    def probs(tokens: set[int]) -> dict[int, float]:
        top = max(row[v] for v in tokens)
        weights = {v: math.exp(row[v] - top) for v in tokens}
        total = sum(weights.values())
        return {v: w / total for v, w in weights.items()}

    p = probs(kept)
    # top-p: drop a token when it and all less likely tokens together weigh <= 1 - top_p.
    tail = {v: sum(q for u, q in p.items() if q <= p[v]) for v in kept}
    best = max(kept, key=lambda v: row[v])
    kept = {v for v in kept if tail[v] > 1 - top_p or v == best}
    p = probs(kept)
    top = max(p.values())
    return {v for v in kept if p[v] >= min_p * top}


def test_top_k_top_p_min_p_match_per_row_reference() -> None:
    rng = random.Random(0)
    num_reqs = 12
    logits = random_logits(num_reqs, seed=3)
    top_k = torch.tensor([rng.choice([0, 1, 2, 5, 20, VOCAB_SIZE, 100]) for _ in range(num_reqs)])
    top_p = torch.tensor([rng.choice([1.0, 0.9, 0.5, 0.1]) for _ in range(num_reqs)])
    min_p = torch.tensor([rng.choice([0.0, 0.05, 0.3]) for _ in range(num_reqs)])
    result = apply_min_p(apply_top_k_top_p(logits.clone(), top_k, top_p), min_p)
    for i in range(num_reqs):
        expected = reference_filter(
            logits[i].tolist(), int(top_k[i]), float(top_p[i]), float(min_p[i])
        )
        kept = set(torch.nonzero(~torch.isinf(result[i])).flatten().tolist())
        assert kept == expected, (i, int(top_k[i]), float(top_p[i]), float(min_p[i]))
        assert torch.equal(result[i, list(kept)], logits[i, list(kept)])
    assert any(len(reference_filter(logits[i].tolist(), 0, 0.5, 0.0)) > 1 for i in range(num_reqs))


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = random_logits(4, seed=5)
    # 1 - 1e-9 rounds to 1.0 in float32: every cumulative sum is "inside the tail".
    result = apply_top_k_top_p(logits.clone(), None, torch.full((4,), 1e-9))
    kept = ~torch.isinf(result)
    assert torch.equal(kept.sum(dim=1), torch.ones(4, dtype=torch.int64))
    assert torch.equal(kept.int().argmax(dim=1), logits.argmax(dim=1))


def test_sampled_tokens_stay_inside_the_filters() -> None:
    params = SamplingParams(temperature=1.5, top_k=5, top_p=0.8, min_p=0.1)
    logits = random_logits(1, seed=4).expand(2000, -1).contiguous()
    _, metadata = make_state([Req(params=params)] * 2000, max_num_reqs=2000)
    out = Sampler()(logits, metadata)
    allowed = reference_filter((logits[0] / 1.5).tolist(), 5, 0.8, 0.1)
    sampled = set(out.sampled_token_ids.tolist())
    assert sampled <= allowed and len(sampled) == len(allowed) > 1


def test_sampled_frequencies_follow_the_tempered_distribution() -> None:
    num_samples, vocab_size, temperature = 20000, 6, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    reqs = [Req(params=SamplingParams(temperature=temperature))] * num_samples
    _, metadata = make_state(reqs, vocab_size=vocab_size, max_num_reqs=num_samples)
    out = Sampler()(row.expand(num_samples, -1).contiguous(), metadata)
    freq = torch.bincount(out.sampled_token_ids, minlength=vocab_size) / num_samples
    torch.testing.assert_close(freq, torch.softmax(row / temperature, dim=0), atol=0.015, rtol=0)


def run_steps(
    state: SamplingState, slots: list[int], row_of: dict[int, int], num_steps: int
) -> list[int]:
    """Samples num_steps tokens for all slots; returns those of the slot `row_of` names.

    Every step's logits are the same nearly flat row for everybody, so a token depends only on
    the noise drawn for it.
    """
    sampler = Sampler()
    (watched,) = row_of
    tokens = []
    for step in range(num_steps):
        logits = random_logits(1, 1000, seed=100 + step).mul(0.01).expand(len(slots), -1)
        out = sampler(logits.contiguous(), state.make_metadata(slots))
        state.append_output_tokens(slots, out.sampled_token_ids)
        tokens.append(int(out.sampled_token_ids[slots.index(watched)]))
    return tokens


def make_seeded_batch(
    seeds_at_slots: dict[int, int | None], greedy_slots: tuple[int, ...] = (), seed: int = 0
) -> SamplingState:
    state = SamplingState(8, 64, 1000, torch.device("cpu"), seed=seed)
    for slot, request_seed in seeds_at_slots.items():
        temperature = 0.0 if slot in greedy_slots else 1.0
        params = SamplingParams(seed=request_seed, temperature=temperature)
        state.add_request(slot, params, [1, 2], [], eos_token_id=None)
    return state


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    num_steps = 6
    alone = run_steps(make_seeded_batch({0: 1234}), [0], {0: 0}, num_steps)
    crowded = make_seeded_batch({1: None, 6: 77, 3: 1234, 2: None, 0: 5}, greedy_slots=(2,))
    with_neighbours = run_steps(crowded, [2, 6, 1, 3, 0], {3: 0}, num_steps)
    other_engine_seed = make_seeded_batch({5: 1234, 4: None}, seed=99)
    reordered = run_steps(other_engine_seed, [4, 5], {5: 0}, num_steps)
    assert alone == with_neighbours == reordered
    other_seed = run_steps(make_seeded_batch({0: 4321}), [0], {0: 0}, num_steps)
    assert other_seed != alone


def test_unseeded_sampling_follows_the_engine_seed() -> None:
    def tokens(engine_seed: int) -> list[int]:
        return run_steps(make_seeded_batch({0: None}, seed=engine_seed), [0], {0: 0}, 4)

    assert tokens(0) == tokens(0) != tokens(1)


def test_resumed_seeded_request_continues_its_stream() -> None:
    uninterrupted = run_steps(make_seeded_batch({0: 42}), [0], {0: 0}, 6)
    state = make_seeded_batch({0: 42})
    first = run_steps(state, [0], {0: 0}, 3)
    state.remove_request(0)
    state.add_request(4, SamplingParams(seed=42), [1, 2], first, eos_token_id=None)
    # run_steps restarts its logits at step 0; shift by re-deriving the resumed steps' logits.
    sampler = Sampler()
    rest = []
    for step in range(3, 6):
        logits = random_logits(1, 1000, seed=100 + step).mul(0.01)
        out = sampler(logits, state.make_metadata([4]))
        state.append_output_tokens([4], out.sampled_token_ids)
        rest.append(int(out.sampled_token_ids[0]))
    assert first + rest == uninterrupted


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    reqs = [
        Req(params=SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5)),
        Req(params=SamplingParams(logprobs=0, suppress_tokens=list(range(10)))),
        Req(params=SamplingParams(temperature=0.0, top_k=2)),
        Req(params=SamplingParams(logprobs=5, temperature=2.0), outputs=[4, 4]),
    ]
    _, metadata = make_state(reqs)
    assert metadata.params.max_num_logprobs == 5
    logits = random_logits(len(reqs), seed=9).to(torch.bfloat16)
    out = Sampler()(logits, metadata)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.ranks is not None
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (len(reqs), 6)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(
        out.logprobs, raw.gather(1, out.logprob_token_ids), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out.logprobs[:, 1:], raw.topk(5).values, atol=1e-5, rtol=0)
    for i in range(len(reqs)):
        values = raw[i].tolist()
        sampled = values[int(out.sampled_token_ids[i])]
        assert int(out.ranks[i]) == sum(v >= sampled for v in values)
    assert int(out.sampled_token_ids[1]) >= 10  # the rules apply, but not to the logprobs
    assert int(out.ranks[2]) == 1  # greedy


def test_processed_logprobs_are_the_rules_on_log_softmax() -> None:
    """logprobs_mode="processed" (beam search): the rules applied to log_softmax of the logits,
    not renormalized (transformers' beam scores); the other rows keep raw logprobs, and every
    row samples as it would otherwise."""
    forced = [[0, 7]]
    reqs = [
        Req(
            params=SamplingParams(
                temperature=0.0, logprobs=4, logprobs_mode="processed", suppress_tokens=[0, 1]
            )
        ),
        Req(params=SamplingParams(logprobs=4, suppress_tokens=[0, 1])),
        Req(params=SamplingParams(logprobs=2, logprobs_mode="processed", forced_token_ids=forced)),
        Req(params=SamplingParams(temperature=0.0, suppress_tokens=[0, 1])),
    ]
    _, metadata = make_state(reqs)
    logits = random_logits(len(reqs), seed=3)
    logits[:, :2] += 50.0  # the suppressed tokens would win
    out = Sampler()(logits, metadata)
    raw = torch.log_softmax(logits, dim=-1)
    masked = raw.clone()
    masked[:, :2] = float("-inf")
    top = masked[0].topk(4)
    assert out.logprob_token_ids[0, 1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(out.logprobs[0, 1:], top.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logprobs[1, 1:], raw[1].topk(4).values, atol=1e-5, rtol=0)
    assert out.logprob_token_ids[2, 1].item() == 7 and out.logprobs[2, 1].item() == 0.0
    assert out.logprobs[2, 2].item() == float("-inf")
    assert [int(t) for t in out.sampled_token_ids[[0, 3]]] == [
        int(masked[0].argmax()),
        int(masked[3].argmax()),
    ]
    assert int(out.sampled_token_ids[2]) == 7


def test_logprobs_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="normalized")


@pytest.mark.parametrize("logprobs", [None, 0])
def test_logprob_outputs_only_when_asked(logprobs: int | None) -> None:
    _, metadata = make_state([Req(params=SamplingParams(logprobs=logprobs))])
    out = Sampler()(random_logits(1), metadata)
    assert (out.logprobs is None) == (logprobs is None)
    if out.logprobs is not None:
        assert out.logprobs.shape == (1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu() -> None:
    """Rules and greedy picks agree across devices; seeded CUDA rows repeat."""
    rules = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        no_repeat_ngram_size=2,
        suppress_tokens=[0, 1],
        min_tokens=3,
        logprobs=4,
    )
    reqs = [
        Req(params=rules.clone(temperature=0.0), outputs=[5, 6, 5], eos_token_id=2),
        Req(params=rules.clone(seed=3, top_k=8, top_p=0.9, min_p=0.05), outputs=[7, 7]),
        Req(params=SamplingParams(seed=11, temperature=0.8)),
        Req(params=SamplingParams(temperature=0.0, allowed_token_ids=[9, 10, 11])),
    ]
    logits = random_logits(len(reqs), seed=21)
    _, cpu_metadata = make_state(reqs)
    cpu = Sampler()(logits, cpu_metadata)
    gpu_tokens = []
    for _ in range(2):
        _, gpu_metadata = make_state(reqs, device="cuda")
        gpu = Sampler()(logits.cuda(), gpu_metadata)
        gpu_tokens.append(gpu.sampled_token_ids.cpu())
        assert gpu.logprobs is not None and cpu.logprobs is not None
        torch.testing.assert_close(gpu.logprobs[:, 1:].cpu(), cpu.logprobs[:, 1:])
    assert torch.equal(gpu_tokens[0], gpu_tokens[1])
    assert torch.equal(gpu_tokens[0][[0, 3]], cpu.sampled_token_ids[[0, 3]])


def test_lm_head_hands_model_dtype_logits_that_sample_like_their_float32_copy() -> None:
    """LM heads return logits in the model dtype (with a padded vocabulary, a strided view of
    the padded GEMM output: no float32 copy); the Sampler upcasts what it processes, so its
    tokens and raw logprobs equal those of a float32 copy of the same logits."""
    from v1.models.layers.embedding import LMHead

    gen = torch.Generator().manual_seed(3)
    vocab = VOCAB_SIZE - 3  # odd: pad_vocab_ pads it
    head = LMHead(vocab, 16)
    head.weight.data = torch.randn(vocab, 16, generator=gen).to(torch.bfloat16)
    assert head.pad_vocab_(VOCAB_SIZE)
    logits = head(torch.randn(3, 16, generator=gen).to(torch.bfloat16))
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, vocab)
    assert logits.stride() == (VOCAB_SIZE, 1)  # a view of the padded output
    reqs = [Req(params=SamplingParams(temperature=0.0, logprobs=2)) for _ in range(3)]
    _, metadata = make_state(reqs, vocab_size=vocab)
    out = Sampler()(logits, metadata)
    want = Sampler()(logits.float().contiguous(), metadata)
    assert torch.equal(out.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=0, rtol=0)
