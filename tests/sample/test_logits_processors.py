"""Batched logits rules against per-row references (plain Python or transformers' processors)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from sample_factories import VOCAB_SIZE, Req, make_state
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from v1.sample import WhisperTokenInfo
from v1.sample.sampler import apply_logits_processors
from v1.sampling_params import SamplingParams

NEG_INF = float("-inf")


def random_logits(num_reqs: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def banned(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isinf(row)).flatten().tolist())


def test_no_rules_leave_logits_unchanged() -> None:
    _, metadata = make_state([Req(), Req(params=SamplingParams(temperature=0.0))])
    logits = random_logits(2)
    assert torch.equal(apply_logits_processors(logits.clone(), metadata), logits)


def reference_penalties(
    row: list[float], prompt: list[int], outputs: list[int], params: SamplingParams
) -> list[float]:
    result = []
    for token, value in enumerate(row):
        if token in prompt or token in outputs:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        count = outputs.count(token)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (count > 0)
        result.append(value)
    return result


def test_penalties_match_per_row_reference() -> None:
    rng = random.Random(0)
    reqs = []
    for i in range(6):
        params = SamplingParams(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
            frequency_penalty=rng.uniform(-2, 2) if i % 3 else 0.0,
            presence_penalty=rng.uniform(-2, 2) if i % 2 else 0.0,
        )
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 20))]
        outputs = [rng.randrange(20) for _ in range(rng.randint(0, 30))]  # repeats likely
        reqs.append(Req(params=params, prompt=prompt, outputs=outputs))
    reqs.append(Req())  # a neutral row in the same batch
    _, metadata = make_state(reqs)
    assert metadata.penalties is not None and metadata.penalties.repetition_penalties is not None
    logits = random_logits(len(reqs))
    result = apply_logits_processors(logits.clone(), metadata)
    for i, req in enumerate(reqs):
        expected = reference_penalties(logits[i].tolist(), req.prompt, req.outputs, req.params)
        torch.testing.assert_close(result[i], torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert torch.equal(result[-1], logits[-1])


def test_no_repeat_ngram_matches_transformers() -> None:
    rng = random.Random(1)
    vocab_size = 8  # small, so that n-grams repeat
    for trial in range(20):
        reqs = []
        for _ in range(6):
            size = rng.choice([0, 1, 2, 3, 4])
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 6))]
            outputs = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 25))]
            params = SamplingParams(no_repeat_ngram_size=size)
            reqs.append(Req(params=params, prompt=prompt, outputs=outputs))
        _, metadata = make_state(reqs, vocab_size=vocab_size)
        logits = random_logits(len(reqs), vocab_size, seed=trial)
        result = apply_logits_processors(logits.clone(), metadata)
        for i, req in enumerate(reqs):
            expected = logits[i : i + 1].clone()
            size = req.params.no_repeat_ngram_size
            if size:
                input_ids = torch.tensor([req.prompt + req.outputs])
                expected = NoRepeatNGramLogitsProcessor(size)(input_ids, expected)
            assert torch.equal(result[i], expected[0]), (trial, i, req)


WHISPER = WhisperTokenInfo(
    eos_token_id=40, no_timestamps_token_id=49, timestamp_begin=50, max_initial_timestamp_index=5
)
WHISPER_VOCAB = 80


def hf_whisper(info: WhisperTokenInfo, prompt_len: int) -> WhisperTimeStampLogitsProcessor:
    config = SimpleNamespace(
        no_timestamps_token_id=info.no_timestamps_token_id,
        eos_token_id=info.eos_token_id,
        bos_token_id=None,
        max_initial_timestamp_index=info.max_initial_timestamp_index,
    )
    return WhisperTimeStampLogitsProcessor(config, begin_index=prompt_len)


def random_whisper_outputs(rng: random.Random, info: WhisperTokenInfo) -> list[int]:
    """Mostly well-formed transcripts (text between timestamp pairs), with some noise."""
    outputs: list[int] = []
    timestamp = info.timestamp_begin + rng.randrange(4)
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.5:
            outputs.append(rng.randrange(info.eos_token_id))
        elif kind < 0.6:
            outputs.append(rng.randrange(info.eos_token_id, info.timestamp_begin))
        else:
            timestamp = min(timestamp + rng.randrange(-1, 4), WHISPER_VOCAB - 1)
            outputs.append(timestamp)
    return outputs


@pytest.mark.parametrize("max_initial", [5, None])
def test_whisper_timestamp_rules_match_transformers(max_initial: int | None) -> None:
    info = WhisperTokenInfo(
        eos_token_id=WHISPER.eos_token_id,
        no_timestamps_token_id=WHISPER.no_timestamps_token_id,
        timestamp_begin=WHISPER.timestamp_begin,
        max_initial_timestamp_index=max_initial,
    )
    rng = random.Random(2)
    num_forced_timestamp = num_after_prefix = 0
    for trial in range(15):
        reqs = []
        for _ in range(8):
            prompt = [rng.randrange(WHISPER_VOCAB) for _ in range(rng.randint(1, 4))]
            outputs = random_whisper_outputs(rng, info)
            params = SamplingParams(whisper_timestamps=rng.random() < 0.85)
            reqs.append(Req(params=params, prompt=prompt, outputs=outputs))
        _, metadata = make_state(reqs, vocab_size=WHISPER_VOCAB, whisper=info)
        logits = random_logits(len(reqs), WHISPER_VOCAB, seed=trial)
        # Shift the timestamp region so that both sides of the probability test occur.
        logits[:, info.timestamp_begin :] += torch.empty(len(reqs), 1).uniform_(-4, 6)
        result = apply_logits_processors(logits.clone(), metadata)
        for i, req in enumerate(reqs):
            expected = logits[i : i + 1].clone()
            if (
                req.params.whisper_timestamps
                and not req.outputs
                and info.ends_with_prefix(req.prompt)
            ):
                # After a forced prefix CTranslate2 (faster-whisper) bans <|notimestamps|> only.
                expected[0, info.no_timestamps_token_id] = float("-inf")
                num_after_prefix += 1
            elif req.params.whisper_timestamps:
                processor = hf_whisper(info, len(req.prompt))
                expected = processor(torch.tensor([req.prompt + req.outputs]), expected)
                num_forced_timestamp += bool(torch.isinf(expected[0, : info.timestamp_begin]).all())
            torch.testing.assert_close(result[i], expected[0], msg=f"{trial} {i} {req}")
    assert num_forced_timestamp > 10  # the probability rule was exercised
    assert num_after_prefix >= 2  # and the first token after a prefix


def test_whisper_resumed_request_matches_appended() -> None:
    """Outputs given on add and outputs appended step by step leave the same rule state."""
    outputs = [52, 3, 4, 55, 55, 7, 56]
    params = SamplingParams(whisper_timestamps=True)
    state_a, _ = make_state([Req(params=params, outputs=outputs)], whisper=WHISPER)
    state_b, _ = make_state([Req(params=params)], whisper=WHISPER)
    logits = random_logits(1, WHISPER_VOCAB)
    for n in range(len(outputs)):
        state_c, _ = make_state([Req(params=params, outputs=outputs[:n])], whisper=WHISPER)
        got_b = apply_logits_processors(logits.clone(), state_b.make_metadata([0]))
        got_c = apply_logits_processors(logits.clone(), state_c.make_metadata([0]))
        assert torch.equal(got_b, got_c)
        state_b.append_output_tokens([0], [outputs[n]])
    got_a = apply_logits_processors(logits.clone(), state_a.make_metadata([0]))
    got_b = apply_logits_processors(logits.clone(), state_b.make_metadata([0]))
    assert torch.equal(got_a, got_b)
    assert banned(got_a[0]) >= set(range(WHISPER.timestamp_begin))  # after "56" a pair closes


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos = 5
    params = SamplingParams(min_tokens=3, stop_token_ids=[7, 9])
    reqs = [
        Req(params=params, eos_token_id=eos),
        Req(params=params.clone(ignore_eos=True), eos_token_id=eos),
        Req(params=SamplingParams(stop_token_ids=[7]), eos_token_id=eos),  # min_tokens 0
    ]
    state, metadata = make_state(reqs)
    logits = torch.zeros(3, VOCAB_SIZE)
    for step in range(5):
        metadata = state.make_metadata([0, 1, 2])
        result = apply_logits_processors(logits.clone(), metadata)
        if step < 3:
            assert banned(result[0]) == {5, 7, 9}
            assert banned(result[1]) == {7, 9}  # EOS is no stop token under ignore_eos
        else:
            assert banned(result[0]) == banned(result[1]) == set()
        assert banned(result[2]) == set()
        state.append_output_tokens([0, 1, 2], [1, 1, 1])


def test_forced_token_ids_at_their_output_index() -> None:
    params = SamplingParams(forced_token_ids=[[0, 11], [2, 22]])
    state, _ = make_state([Req(params=params), Req()])
    logits = random_logits(2)
    for step in range(4):
        result = apply_logits_processors(logits.clone(), state.make_metadata([0, 1]))
        forced = {0: 11, 2: 22}.get(step)
        if forced is None:
            assert torch.equal(result[0], logits[0])
        else:
            assert banned(result[0]) == set(range(VOCAB_SIZE)) - {forced}
            assert result[0, forced] == 0
        assert torch.equal(result[1], logits[1])
        state.append_output_tokens([0, 1], [3, 3])


@pytest.mark.parametrize(
    ("max_tokens", "max_output_tokens", "prompt_len", "last_index"),
    [(4, None, 3, 3), (10, 3, 3, 2), (None, None, 90, 5), (50, None, 94, 1)],
)
def test_forced_eos_on_last_allowed_token(
    max_tokens: int | None,
    max_output_tokens: int | None,
    prompt_len: int,
    last_index: int,
) -> None:
    """The last index comes from max_tokens, the runner's override, or max_model_len (96)."""
    params = SamplingParams(max_tokens=max_tokens, forced_eos_token_id=2)
    req = Req(params=params, prompt=[1] * prompt_len, max_output_tokens=max_output_tokens)
    state, _ = make_state([req])
    logits = random_logits(1)
    for step in range(last_index + 1):
        result = apply_logits_processors(logits.clone(), state.make_metadata([0]))
        if step == last_index:
            assert banned(result[0]) == set(range(VOCAB_SIZE)) - {2}
        else:
            assert torch.equal(result, logits)
        state.append_output_tokens([0], [3])


def test_allowed_suppress_and_begin_suppress() -> None:
    reqs = [
        Req(params=SamplingParams(allowed_token_ids=[3, 4, 60])),
        Req(params=SamplingParams(suppress_tokens=[0, 8, 63])),
        Req(params=SamplingParams(begin_suppress_tokens=[5, 6])),
        Req(params=SamplingParams(begin_suppress_tokens=[5, 6]), outputs=[1]),
        Req(params=SamplingParams(suppress_tokens=[1], allowed_token_ids=[1, 2])),
        Req(),
    ]
    _, metadata = make_state(reqs)
    logits = random_logits(len(reqs))
    result = apply_logits_processors(logits.clone(), metadata)
    assert banned(result[0]) == set(range(VOCAB_SIZE)) - {3, 4, 60}
    assert banned(result[1]) == {0, 8, 63}
    assert banned(result[2]) == {5, 6}
    assert banned(result[3]) == set()  # not the first output token any more
    assert banned(result[4]) == set(range(VOCAB_SIZE)) - {2}
    assert banned(result[5]) == set()
    kept = ~torch.isinf(result)
    assert torch.equal(result[kept], logits[kept])
    assert math.isinf(NEG_INF) and result.min() == NEG_INF
