"""SamplingState bookkeeping: slot reuse, token history, resumed requests and metadata flags."""

from __future__ import annotations

import pytest
import torch
from sample_factories import MAX_MODEL_LEN, VOCAB_SIZE, Req, make_state

from v1.sample import SamplingState, WhisperTokenInfo
from v1.sample.sampler import apply_logits_processors
from v1.sampling_params import SamplingParams

RULES = SamplingParams(
    temperature=0.3,
    top_k=4,
    top_p=0.5,
    min_p=0.2,
    seed=7,
    repetition_penalty=1.2,
    no_repeat_ngram_size=2,
    allowed_token_ids=[1, 2, 3],
    suppress_tokens=[4],
    begin_suppress_tokens=[5],
    min_tokens=2,
    stop_token_ids=[6],
    forced_token_ids=[[0, 2]],
    forced_eos_token_id=3,
    logprobs=2,
)


def test_removed_slot_leaves_nothing_behind() -> None:
    state, metadata = make_state([Req(params=RULES, eos_token_id=9), Req()])
    assert metadata.params.max_num_logprobs == 2 and metadata.penalties is not None
    assert (
        metadata.params.top_k is not None
        and metadata.params.top_p is not None
        and metadata.params.min_p is not None
    )
    assert set(metadata.params.generators) == {0}
    state.remove_request(0)
    state.add_request(0, SamplingParams(), [1, 2], [], eos_token_id=9)
    fresh = state.make_metadata([1, 0])
    assert (
        fresh.params.max_num_logprobs is None
        and fresh.penalties is None
        and not fresh.params.generators
    )
    assert fresh.params.top_k is None and fresh.params.top_p is None and fresh.params.min_p is None
    assert fresh.token_tables is None and fresh.whisper is None
    logits = torch.randn(2, VOCAB_SIZE)
    assert torch.equal(apply_logits_processors(logits.clone(), fresh), logits)


def test_greedy_rows_skip_random_only_settings() -> None:
    greedy = RULES.clone(temperature=0.0)
    _, metadata = make_state([Req(params=greedy)])
    assert metadata.params.all_greedy and not metadata.params.generators
    assert (
        metadata.params.top_k is None
        and metadata.params.top_p is None
        and metadata.params.min_p is None
    )


def test_history_holds_prompt_then_outputs() -> None:
    state, _ = make_state([Req(prompt=[7, 8], outputs=[9]), Req(prompt=[1])], slots=[3, 1])
    state.append_output_tokens(torch.tensor([1, 3]), torch.tensor([11, 12]))
    state.append_output_tokens([3], [13])
    assert state.penalties.token_ids[3, :5].tolist() == [7, 8, 9, 12, 13]
    assert state.penalties.token_ids[1, :2].tolist() == [1, 11]
    assert state.num_prompt_tokens[[3, 1]].tolist() == [2, 1]
    assert state.num_output_tokens[[3, 1]].tolist() == [3, 1]
    metadata = state.make_metadata([1, 3])
    assert metadata.penalties is None  # no rule reads the history
    state.remove_request(1)
    state.add_request(1, SamplingParams(presence_penalty=1.0), [5], [6], eos_token_id=None)
    metadata = state.make_metadata([1, 3])
    penalties = metadata.penalties
    assert penalties is not None and penalties.no_repeat_ngram_size is None
    assert penalties.token_ids[0, :2].tolist() == [5, 6]
    assert penalties.token_ids.shape == (2, 2)  # only as wide as the rows that read it


def test_resumed_request_equals_appended_one() -> None:
    params = SamplingParams(no_repeat_ngram_size=2, frequency_penalty=0.5, min_tokens=5)
    outputs = [3, 4, 5, 3]
    resumed, _ = make_state([Req(params=params, outputs=outputs, eos_token_id=1)])
    stepped, _ = make_state([Req(params=params, eos_token_id=1)])
    for token in outputs:
        stepped.append_output_tokens([0], [token])
    logits = torch.randn(1, VOCAB_SIZE)
    got = apply_logits_processors(logits.clone(), resumed.make_metadata([0]))
    assert torch.equal(got, apply_logits_processors(logits.clone(), stepped.make_metadata([0])))
    assert torch.isinf(got[0, 4]) and torch.isinf(got[0, 1])  # "3 4" repeats; min_tokens


def test_invalid_requests_are_refused() -> None:
    state = SamplingState(2, MAX_MODEL_LEN, VOCAB_SIZE, torch.device("cpu"))
    with pytest.raises(ValueError, match="whisper_timestamps"):
        state.add_request(0, SamplingParams(whisper_timestamps=True), [1], [], None)
    with pytest.raises(ValueError, match="max_model_len"):
        state.add_request(0, SamplingParams(), [1] * MAX_MODEL_LEN, [2], None)
    assert not bool(state.active.any())


def test_whisper_state_tracks_timestamp_pairs() -> None:
    info = WhisperTokenInfo(eos_token_id=40, no_timestamps_token_id=49, timestamp_begin=50)
    params = SamplingParams(whisper_timestamps=True)
    state, _ = make_state([Req(params=params)], vocab_size=80, whisper=info)
    expected = [  # (is_first, block_timestamps, block_text, min_timestamp) before each token
        (52, (True, False, False, 50)),
        (3, (False, True, False, 53)),  # one timestamp only: text must follow
        (55, (False, False, False, 53)),
        (60, (False, False, True, 55)),  # lone timestamp: its pair, >= itself
        (1, (False, True, False, 61)),
    ]
    for token, (is_first, block_ts, block_text, min_ts) in expected:
        whisper = state.make_metadata([0]).whisper
        assert whisper is not None
        got = (
            bool(whisper.is_first[0]),
            bool(whisper.block_timestamps[0]),
            bool(whisper.block_text[0]),
            int(whisper.min_timestamp[0]),
        )
        assert got == (is_first, block_ts, block_text, min_ts), token
        state.append_output_tokens([0], [token])


def test_whisper_state_with_rows_that_use_no_timestamps() -> None:
    """Only timestamp rows update their timestamp state; a batch mixing both keeps each exact."""
    info = WhisperTokenInfo(eos_token_id=40, no_timestamps_token_id=49, timestamp_begin=50)
    timestamps = SamplingParams(whisper_timestamps=True)
    state, _ = make_state(
        [Req(), Req(params=timestamps), Req()], vocab_size=80, whisper=info, slots=[2, 0, 1]
    )
    for tokens in ([7, 52, 8], [60, 3, 61], [9, 55, 52]):
        state.append_output_tokens([2, 0, 1], tokens)
    whisper = state.make_metadata([1, 0, 2]).whisper
    assert whisper is not None and whisper.rows.tolist() == [1]  # only slot 0's row
    # Slot 0 saw 52, 3, 55: a lone timestamp last, so its pair (>= 55) must follow.
    assert bool(whisper.block_text[0]) and not bool(whisper.block_timestamps[0])
    assert int(whisper.min_timestamp[0]) == 55
    assert state.penalties.token_ids[0, 3:6].tolist() == [52, 3, 55]
    assert state.penalties.token_ids[1, 3:6].tolist() == [8, 61, 52]


def test_whisper_first_token_after_a_forced_prefix_is_free() -> None:
    """faster-whisper's prefix (`sot sequence <|0.00|> text`): CTranslate2 bans only
    <|notimestamps|> at the first sampled token, even where the timestamps' total probability
    wins and past max_initial_timestamp; from the second token on the rules hold as usual, over
    the sampled tokens only. Without the prefix the first token is an early timestamp."""
    info = WhisperTokenInfo(
        eos_token_id=40,
        no_timestamps_token_id=49,
        timestamp_begin=50,
        max_initial_timestamp_index=2,
    )
    params = SamplingParams(whisper_timestamps=True)
    sot_sequence = [41, 43, 45]
    prefixed = Req(params=params, prompt=[*sot_sequence, 50, 7, 8])
    plain = Req(params=params, prompt=sot_sequence)
    text_only = Req(params=params, prompt=[1, 2, 3])  # no special token: no prefix known
    state, metadata = make_state([prefixed, plain, text_only], vocab_size=80, whisper=info)
    logits = torch.zeros(3, 80)
    logits[:, 50:] = 2.0  # the timestamps' mass beats every text token
    logits[:, 70] = 5.0
    out = apply_logits_processors(logits.clone(), metadata)
    # After the prefix: everything but <|notimestamps|>, late timestamps and text included.
    assert torch.isinf(out[0, 49]) and torch.isfinite(out[0, :49]).all()
    assert torch.isfinite(out[0, 50:]).all() and int(out[0].argmax()) == 70
    for row in (1, 2):  # the usual first rule: a timestamp <= <|0.04|>
        assert torch.isinf(out[row, :50]).all() and torch.isfinite(out[row, 50:53]).all()
        assert torch.isinf(out[row, 53:]).all()
    state.append_output_tokens([0, 1, 2], [70, 51, 51])
    second = state.make_metadata([0, 1, 2]).whisper
    assert second is not None and not bool(second.after_prefix.any())
    assert not bool(second.is_first.any())
    # The first sampled token counts as a pair on its own (CTranslate2 and transformers alike).
    assert second.block_timestamps.tolist() == [True, True, True]


def test_new_requests_histories_go_in_one_copy(monkeypatch) -> None:
    """A step's new requests reach the device history in one copy and one scatter when the
    state flushes (not two device ops a request); a slot taken, freed and taken again before
    the flush keeps only its last request's history."""
    import v1.host_copy as host_copy
    import v1.sample.states.penalties as penalties_module

    state = SamplingState(8, MAX_MODEL_LEN, VOCAB_SIZE, torch.device("cpu"))
    copies: list[int] = []
    to_device = host_copy.to_device

    def counted(array, device):
        copies.append(len(array))
        return to_device(array, device)

    # The penalties' own copies, and those `parts_to_device` makes for them.
    monkeypatch.setattr(penalties_module, "to_device", counted)
    monkeypatch.setattr(host_copy, "to_device", counted)
    state.add_request(2, SamplingParams(), [7, 8, 9], [], eos_token_id=None)
    state.add_request(5, SamplingParams(), [1], [4, 6], eos_token_id=None)
    state.add_request(0, SamplingParams(), [3, 3], [], eos_token_id=None)
    state.remove_request(0)
    state.add_request(0, SamplingParams(), [2], [], eos_token_id=None)
    assert copies == []  # nothing reaches the device before the step needs it
    state.make_metadata([2, 5, 0])
    assert copies[:1] == [3 * (3 + 3 + 1)]  # values, rows and columns of 7 tokens: one copy
    history = state.penalties.token_ids
    assert history[2, :3].tolist() == [7, 8, 9]
    assert history[5, :3].tolist() == [1, 4, 6]
    assert history[0, :2].tolist() == [2, 0]
    copies.clear()
    state.make_metadata([2, 5, 0])
    assert all(n != 21 for n in copies)  # written once
