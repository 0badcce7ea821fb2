"""faster-whisper's transcription options through the public `Transcriber` over the scripted
engine of test_transcription_plan.py: what each option puts in the window requests (prompt
tokens, sampling rules) and how it moves the windows (clip_timestamps, without_timestamps,
multilingual, hallucination_silence_threshold). Each test fails if its option were ignored.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.test_transcription_plan import (
    EN,
    EOS,
    NO_TS,
    PREV,
    SOT,
    SR,
    TB,
    TRANSCRIBE,
    Call,
    Reply,
    in_order,
    noise,
    scripted,
    ts,
    words,
)
from tests.utils import make_tiny_whisper_dir
from v1.config import ModelConfig
from v1.engine.transcription import Transcriber
from v1.tokenizer import get_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def whisper_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Any]:
    config = ModelConfig(make_tiny_whisper_dir(Path(tmp_path_factory.mktemp("tiny"))))
    return config, get_tokenizer(config)


def test_hotwords_go_in_every_prompt_unless_a_prefix_is_given(whisper_config) -> None:
    tok = whisper_config[1]
    hot = words(tok, " Quilter Kennedy")
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(1)]))
    Transcriber(engine).transcribe((noise(40), SR), language="en", hotwords="Quilter Kennedy")
    for call in engine.calls:
        assert call.prompt_ids[: 1 + len(hot)] == [PREV, *hot]
    first_window, second = engine.calls
    assert first_window.prompt_ids == [PREV, *hot, SOT, EN, TRANSCRIBE]
    # The previous text follows the hotwords.
    assert second.prompt_ids[1 + len(hot) : -3] == [ts(0), *words(tok, " Hi."), ts(1)]

    engine = scripted(whisper_config, lambda call: Reply(words(tok, " Hi.")))
    Transcriber(engine).transcribe((noise(5), SR), language="en", hotwords="Quilter", prefix="So")
    assert PREV not in engine.calls[0].prompt_ids


def test_prefix_is_forced_with_timestamps_in_the_window_at_0_s_only(whisper_config) -> None:
    """faster-whisper's `get_prompt(prefix=options.prefix if seek == 0 else None)`: the window
    at 0 s is `sot sequence <|0.00|> prefix` with the timestamps on (not <|notimestamps|>), its
    hotwords left out and max_initial_timestamp lifted (the sampler frees the first token
    after the prefix); later windows get the hotwords and no prefix."""
    tok = whisper_config[1]
    pre, hot = words(tok, " And so"), words(tok, " Quilter")
    first_reply = [*words(tok, " my fellow."), ts(2), ts(2), *words(tok, " Then."), ts(4)]
    replies = [Reply(first_reply), Reply([ts(0), *words(tok, " End."), ts(3)])]
    engine = scripted(whisper_config, in_order(replies))
    (result,) = Transcriber(engine).transcribe(
        (noise(40), SR),
        language="en",
        prefix="And so",
        hotwords="Quilter",
        max_initial_timestamp=0.5,
    )
    first, second = engine.calls
    assert first.prompt_ids == [SOT, EN, TRANSCRIBE, ts(0), *pre]
    assert first.params.whisper_timestamps and second.params.whisper_timestamps
    assert not any(t >= TB for t in first.params.begin_suppress_tokens)
    assert ts(0.52) in second.params.begin_suppress_tokens  # max_initial_timestamp there
    # The second window (from 30 s: the first ended on a single timestamp): hotwords, then
    # the first window's tokens (the prefix among them) as previous text; no prefix.
    assert second.prompt_ids[: 1 + len(hot)] == [PREV, *hot]
    assert second.prompt_ids[1 + len(hot) : -3] == [ts(0), *pre, *first_reply]
    assert second.prompt_ids[-3:] == [SOT, EN, TRANSCRIBE]
    got = [(s.start, s.end, s.text) for s in result.segments]
    assert got == [
        (0.0, 2.0, " And so my fellow."),
        (2.0, 4.0, " Then."),
        (30.0, 33.0, " End."),
    ]
    # A first window that starts past 0 s (clip_timestamps) gets no prefix, as faster-whisper.
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(1)]))
    Transcriber(engine).transcribe(
        (noise(10), SR), language="en", prefix="And so", hotwords="Quilter", clip_timestamps="5"
    )
    (call,) = engine.calls
    assert call.prompt_ids == [PREV, *hot, SOT, EN, TRANSCRIBE]


def test_initial_prompt_is_the_previous_text_of_the_first_window(whisper_config) -> None:
    tok = whisper_config[1]
    engine = scripted(whisper_config, lambda call: Reply(words(tok, " Hi.")))
    Transcriber(engine).transcribe((noise(5), SR), language="en", initial_prompt="Glossary")
    assert engine.calls[0].prompt_ids == [
        PREV,
        *words(tok, " Glossary"),
        SOT,
        EN,
        TRANSCRIBE,
        NO_TS,
    ]
    with pytest.raises(ValueError, match="not both"):
        Transcriber(engine).transcribe((noise(5), SR), prompt="a", initial_prompt="b")


def test_sampling_rules_reach_the_window_requests(whisper_config) -> None:
    tok = whisper_config[1]
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(1)]))
    builder_default = Transcriber(engine).builder.suppress_tokens
    Transcriber(engine).transcribe(
        (noise(5), SR),
        language="en",
        timestamps=True,
        suppress_tokens=[-1, 1234],
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        max_initial_timestamp=0.5,
    )
    (call,) = engine.calls
    params = call.params
    assert 1234 in params.suppress_tokens and set(builder_default) <= set(params.suppress_tokens)
    assert TRANSCRIBE in params.suppress_tokens and SOT in params.suppress_tokens
    assert params.repetition_penalty == 1.3 and params.no_repeat_ngram_size == 3
    begin = set(params.begin_suppress_tokens)
    assert ts(0.5) not in begin and ts(0.52) in begin and ts(1.0) in begin
    assert EOS in begin  # suppress_blank (default) still holds

    engine = scripted(whisper_config, lambda call: Reply(words(tok, " Hi.")))
    Transcriber(engine).transcribe(
        (noise(5), SR), language="en", suppress_tokens=[], suppress_blank=False
    )
    params = engine.calls[0].params
    assert set(params.suppress_tokens) <= {SOT, PREV, TRANSCRIBE, 50358, 50362}  # specials only
    assert EOS not in (params.begin_suppress_tokens or [])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_initial_timestamp": 2.0}, "at most the model's 1.00 s"),
        ({"suppress_tokens": [10**6]}, "outside the vocabulary"),
        ({"suppress_tokens": "1,2"}, "list of token ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"clip_timestamps": "3,1"}, "must increase"),
        ({"clip_timestamps": "a,b"}, "numbers separated by commas"),
        ({"vad_parameters": {"threshhold": 0.3}}, "unknown vad_parameters"),
        ({"hallucination_silence_threshold": 2.0}, "needs word_timestamps"),
        ({"timestamps": True, "without_timestamps": True}, "contradict"),
        ({"batch_size": 0}, "batch_size"),
        ({"best_off": 2}, r"unknown transcription option"),
    ],
)
def test_bad_faster_whisper_options_are_value_errors(whisper_config, options, message) -> None:
    engine = scripted(whisper_config, lambda call: Reply([]))
    with pytest.raises(ValueError, match=message):
        Transcriber(engine).transcribe((noise(2), SR), language="en", **options)
    assert engine.calls == []


def test_clip_timestamps_decode_only_those_spans_on_the_original_clock(whisper_config) -> None:
    tok = whisper_config[1]
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(2)]))
    audio = noise(100)
    (result,) = Transcriber(engine).transcribe(
        (audio, SR), language="en", clip_timestamps="10,15,50.5,70"
    )
    starts = [round(c.audio.shape[0] / SR, 2) for c in engine.calls]
    # 10-15 s; then 50.5-70 s in windows 50.5-52.5-... (each ends on its one segment).
    assert starts[0] == 5.0
    np.testing.assert_array_equal(engine.calls[0].audio, audio[10 * SR : 15 * SR])
    np.testing.assert_array_equal(engine.calls[1].audio, audio[int(50.5 * SR) : 70 * SR])
    assert result.segments[0].start == 10.0 and result.segments[0].end == 12.0
    assert result.segments[1].start == 50.5
    assert all(
        (s.start >= 10 and s.end <= 15) or (s.start >= 50.5 and s.end <= 70)
        for s in result.segments
    )
    # A list works as the string does.
    engine2 = scripted(whisper_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(2)]))
    Transcriber(engine2).transcribe((audio, SR), language="en", clip_timestamps=[10, 15, 50.5, 70])
    assert [c.audio.shape for c in engine2.calls] == [c.audio.shape for c in engine.calls]


def test_without_timestamps_decodes_whole_windows(whisper_config) -> None:
    tok = whisper_config[1]
    engine = scripted(whisper_config, lambda call: Reply(words(tok, " Hi.")))
    (result,) = Transcriber(engine).transcribe(
        (noise(70), SR), language="en", without_timestamps=True
    )
    assert all(c.prompt_ids[-1] == NO_TS for c in engine.calls)
    assert [(s.start, s.end) for s in result.segments] == [(0.0, 30.0), (30.0, 60.0), (60.0, 70.0)]


def test_multilingual_detects_every_window_and_segments_carry_it(whisper_config) -> None:
    tok = whisper_config[1]
    de, fr = 50261, 50265
    langs = iter([de, fr])

    def answer(call: Call) -> Reply:
        if "-language" in call.request_id:
            return Reply([next(langs)], logprob=math.log(0.9))
        return Reply([ts(0), *words(tok, " Hi."), ts(30)])

    engine = scripted(whisper_config, answer)
    (result,) = Transcriber(engine).transcribe((noise(50), SR), multilingual=True)
    windows = [c for c in engine.calls if "-language" not in c.request_id]
    assert [w.prompt_ids[w.prompt_ids.index(SOT) + 1] for w in windows] == [de, fr]
    assert [s.language for s in result.segments] == ["de", "fr"]
    assert result.language == "de" and result.language_probability == pytest.approx(0.9)


def test_hallucination_after_a_long_silence_is_skipped(aligned_config) -> None:
    """A first segment of zero-length words 20 s into the window is a hallucination after
    silence: with the threshold the window is decoded again from 20 s and the segment goes."""
    tok = aligned_config[1]
    ghost = words(tok, " Thanks.")
    real = words(tok, " Real words here.")

    def answer(call: Call) -> Reply:
        if call.request_id.endswith("-0"):  # the first window
            return Reply([ts(20), *ghost, ts(20)], token_times=[20.0] * (len(ghost) + 1))
        step = [0.5 * k for k in range(len(real) + 1)]
        return Reply([ts(0), *real, ts(2)], token_times=step)

    def run(**options):
        engine = scripted(aligned_config, answer)
        (result,) = Transcriber(engine).transcribe(
            (noise(40), SR), language="en", word_timestamps=True, **options
        )
        return engine, result

    engine, result = run()
    assert result.segments[0].text == " Thanks."  # kept without the option
    engine, result = run(hallucination_silence_threshold=2.0)
    assert " Thanks." not in [s.text for s in result.segments]
    assert engine.calls[1].audio.shape[0] == 20 * SR  # decoded again from 20 s
    assert result.segments[0].start == 20.0 and result.segments[0].text == " Real words here."
