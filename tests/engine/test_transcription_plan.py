"""The long-form plan through the public `Transcriber` over a scripted engine (a stand-in for
LLMEngine whose replies each test writes): windows seek to the last complete segment, carry
the text before them, fall back to hotter temperatures, skip silence, and files share steps.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.utils import WHISPER_BASE, make_tiny_whisper_dir
from v1.config import ModelConfig
from v1.engine.input_processor import InputProcessor
from v1.engine.transcription import Transcriber, TranscriptionError
from v1.outputs import CompletionOutput, Logprob, RequestOutput
from v1.sampling_params import SamplingParams
from v1.tokenizer import get_tokenizer

pytestmark = pytest.mark.skipif(
    not WHISPER_BASE.is_dir(), reason="needs whisper-base's tokenizer files"
)
SR = 16_000
TB, EOS, PREV, SOT, EN, TRANSCRIBE, NO_TS = 50364, 50257, 50361, 50258, 50259, 50359, 50363


def ts(seconds: float) -> int:
    return TB + round(seconds / 0.02)


@dataclass
class Reply:
    tokens: list[int]
    logprob: float = -0.1
    """Of every token (EOS included)."""
    no_speech_prob: float = 0.01
    token_times: list[float] | None = None
    """Boundary times of the text tokens (word_timestamps requests)."""


@dataclass
class Call:
    request_id: str
    prompt_ids: list[int]
    audio: np.ndarray
    params: SamplingParams


@dataclass
class ScriptedEngine:
    """add_processed_request / step / abort_request like LLMEngine; every request finishes on
    the step after it was added, with `answer(call)`'s tokens and an EOS."""

    model_config: ModelConfig
    tokenizer: Any
    answer: Callable[[Call], Reply]
    calls: list[Call] = field(default_factory=list)
    steps: list[list[str]] = field(default_factory=list)
    pending: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.input_processor = InputProcessor(self.model_config, self.tokenizer)

    def batched_adds(self) -> AbstractContextManager[None]:
        return nullcontext()

    def add_processed_request(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams,
        core_requests: Any,
        *,
        lazy_logprobs: bool = False,
    ) -> None:
        samples = prompt["multi_modal_data"]["audio"].samples  # an AudioClip (16 kHz)
        assert core_requests[0].encoder_input.audio is samples  # the request carries them as is
        call = Call(request_id, list(prompt["prompt_token_ids"]), samples, params)
        self.calls.append(call)
        self.pending.append(call)

    def step(self) -> list[RequestOutput]:
        batch, self.pending = self.pending, []
        self.steps.append([c.request_id for c in batch])
        outputs = []
        for call in batch:
            reply = self.answer(call)
            tokens = [*reply.tokens, EOS]
            logprobs = [{t: Logprob(reply.logprob)} for t in tokens]
            completion = CompletionOutput(0, "", tokens, None, logprobs, "stop")
            extras: dict[str, Any] = {"no_speech_prob": reply.no_speech_prob}
            if reply.token_times is not None:
                extras["token_times"] = reply.token_times
            outputs.append(
                RequestOutput(call.request_id, None, [], [completion], True, extras=extras)
            )
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        self.pending = [c for c in self.pending if c.request_id not in request_ids]


@pytest.fixture(scope="module")
def whisper_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Any]:
    config = ModelConfig(make_tiny_whisper_dir(Path(tmp_path_factory.mktemp("tiny"))))
    return config, get_tokenizer(config)


def scripted(whisper_config: tuple[ModelConfig, Any], answer: Callable[[Call], Reply]) -> Any:
    config, tokenizer = whisper_config
    return ScriptedEngine(config, tokenizer, answer)


def words(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * SR))).astype(np.float32)


def in_order(replies: list[Reply]) -> Callable[[Call], Reply]:
    queue = list(replies)
    return lambda call: queue.pop(0)


def test_windows_seek_to_the_last_complete_segment_and_carry_the_text(whisper_config) -> None:
    tok = whisper_config[1]
    a, b, c, d, e = (words(tok, f" Sentence {w}.") for w in ("one", "two", "three", "four", "5"))
    replies = [
        Reply([ts(0), *a, ts(11), ts(11), *b, ts(22), ts(22), *c]),  # c: cut by the edge
        Reply([ts(0), *c, ts(11), ts(11), *d, ts(20)]),  # ends on one timestamp: done
        Reply([ts(0), *e, ts(5)]),
    ]
    audio = noise(75.465)
    runs = {}
    for timestamps in (True, False):
        engine = scripted(whisper_config, in_order(list(replies)))
        (result,) = Transcriber(engine).transcribe(
            (audio, SR), language="en", timestamps=timestamps
        )
        runs[timestamps] = (engine, result)
    engine, result = runs[True]
    seeks = [0, 2200, 5200]
    assert len(engine.calls) == 3
    for call, seek in zip(engine.calls, seeks, strict=True):
        size = min(3000, 7546 - seek) * 160
        np.testing.assert_array_equal(call.audio, audio[seek * 160 : seek * 160 + size])
        assert call.params.whisper_timestamps and call.params.temperature == 0.0
    assert engine.calls[0].prompt_ids == [SOT, EN, TRANSCRIBE]
    history = [ts(0), *a, ts(11), ts(11), *b, ts(22)]
    assert engine.calls[1].prompt_ids == [PREV, *history, SOT, EN, TRANSCRIBE]
    history += [ts(0), *c, ts(11), ts(11), *d, ts(20)]
    assert engine.calls[2].prompt_ids == [PREV, *history, SOT, EN, TRANSCRIBE]
    spans = [(s.start, s.end, s.tokens) for s in result.segments]
    assert spans == [(0, 11, a), (11, 22, b), (22, 33, c), (33, 42, d), (52, 57, e)]
    assert [s.seek for s in result.segments] == [0, 0, 2200, 2200, 5200]
    assert result.text == tok.decode(a + b + c + d + e)
    # Without timestamps the windows seek the same way: same requests, same text.
    engine_plain, plain = runs[False]
    assert [c.prompt_ids for c in engine_plain.calls] == [c.prompt_ids for c in engine.calls]
    assert plain.text == result.text


def test_fallback_decodes_hotter_and_a_hot_window_resets_the_prompt(whisper_config) -> None:
    tok = whisper_config[1]
    a, b, c, d = (words(tok, f" Part {w}.") for w in ("one", "two", "three", "four"))
    loop = [ts(0)] + words(tok, " again and") * 40
    unlikely = Reply([ts(0), *b, ts(9)], logprob=-1.5)
    replies = [
        Reply(loop),  # compression ratio far above 2.4
        Reply([ts(0), *a, ts(9)]),  # T=0.2: kept, still conditions the next window
        unlikely,
        unlikely,
        unlikely,
        Reply([ts(0), *b, ts(9)]),  # T=0.6: kept, but the next window starts afresh
        Reply([ts(0), *c, ts(9)]),
        Reply([ts(0), *d, ts(9)]),
    ]
    engine = scripted(whisper_config, in_order(replies))
    (result,) = Transcriber(engine).transcribe((noise(120), SR), language="en")
    temperatures = [c.params.temperature for c in engine.calls]
    assert temperatures == [0.0, 0.2, 0.0, 0.2, 0.4, 0.6, 0.0, 0.0]
    assert [c.request_id.rsplit("-", 2)[-2:] for c in engine.calls[:3]] == [
        ["0", "0"],
        ["0", "t1"],
        ["0", "1"],
    ]
    prompts = [c.prompt_ids for c in engine.calls]
    assert prompts[0] == prompts[1] == [SOT, EN, TRANSCRIBE]
    assert prompts[2] == [PREV, ts(0), *a, ts(9), SOT, EN, TRANSCRIBE]
    assert prompts[6] == [SOT, EN, TRANSCRIBE]  # after the window kept at T=0.6
    assert prompts[7] == [PREV, ts(0), *c, ts(9), SOT, EN, TRANSCRIBE]
    assert [(s.tokens, s.temperature) for s in result.segments] == [
        (a, 0.2),
        (b, 0.6),
        (c, 0.0),
        (d, 0.0),
    ]
    assert [s.start for s in result.segments] == [0.0, 30.0, 60.0, 90.0]
    assert result.segments[1].avg_logprob == pytest.approx(-0.1)


def test_fallback_ends_at_the_last_temperature(whisper_config) -> None:
    tok = whisper_config[1]
    a = words(tok, " Hard to hear.")
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *a, ts(3)], logprob=-2.0))
    (result,) = Transcriber(engine).transcribe(
        (noise(4), SR), language="en", timestamps=True, no_speech_threshold=None
    )
    assert [c.params.temperature for c in engine.calls] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    (segment,) = result.segments
    assert (segment.tokens, segment.temperature) == (a, 1.0)
    assert segment.avg_logprob == pytest.approx(-2.0)
    # A fixed temperature (or schedule) replaces the default one.
    engine = scripted(whisper_config, lambda call: Reply([ts(0), *a, ts(3)], logprob=-2.0))
    Transcriber(engine).transcribe((noise(4), SR), language="en", temperature=(0.1, 0.7))
    assert [c.params.temperature for c in engine.calls] == [0.1, 0.7]


def test_silence_is_skipped_without_fallback(whisper_config) -> None:
    tok = whisper_config[1]
    a = words(tok, " Finally speech.")
    silence = Reply([ts(0), *words(tok, " you"), ts(2)], logprob=-1.4, no_speech_prob=0.93)
    engine = scripted(whisper_config, in_order([silence, Reply([ts(0), *a, ts(4)])]))
    (result,) = Transcriber(engine).transcribe((noise(40), SR), language="en")
    assert len(engine.calls) == 2  # no hotter retries of the silent window
    assert len(engine.calls[1].audio) == 10 * SR  # the next window starts after it
    assert engine.calls[1].prompt_ids == [SOT, EN, TRANSCRIBE]
    assert [(s.start, s.end, s.tokens) for s in result.segments] == [(30.0, 34.0, a)]


def test_files_share_engine_steps_and_keep_their_order(whisper_config) -> None:
    tok = whisper_config[1]
    by_length = {60: " long", 10: " short", 40: " middle"}

    def answer(call: Call) -> Reply:
        file_index = int(call.request_id.split("-")[2])
        name = list(by_length.values())[file_index]
        return Reply([ts(0), *words(tok, name), ts(29.5 if len(call.audio) == 30 * SR else 5)])

    audio = [(noise(seconds, seed=i), SR) for i, seconds in enumerate(by_length)]
    engine = scripted(whisper_config, answer)
    results = Transcriber(engine).transcribe(audio, language="en", timestamps=True)
    assert [r.text for r in results] == [" long long", " short", " middle middle"]
    assert [len(ids) for ids in engine.steps] == [3, 2]  # every file's next window, each step
    one_at_a_time = scripted(whisper_config, answer)
    again = Transcriber(one_at_a_time, max_active_files=1).transcribe(audio, language="en")
    assert [r.text for r in again] == [r.text for r in results]
    assert max(len(ids) for ids in one_at_a_time.steps) == 1


def test_short_audio_without_timestamps_is_one_request_after_detection(whisper_config) -> None:
    tok = whisper_config[1]
    text = words(tok, " Short and sweet.")

    def answer(call: Call) -> Reply:
        if call.request_id.endswith("-language"):
            return Reply([50261])  # <|de|>
        return Reply(text)

    engine = scripted(whisper_config, answer)
    audio = noise(12)
    (result,) = Transcriber(engine).transcribe((audio, SR))
    detect, window = engine.calls
    assert detect.params.max_tokens == 1 and detect.audio is window.audio
    assert window.prompt_ids == [SOT, 50261, TRANSCRIBE, NO_TS]
    assert not window.params.whisper_timestamps
    assert result.language == "de" and result.text == tok.decode(text)
    assert [(s.start, s.end) for s in result.segments] == [(0.0, 12.0)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperatures": (0.0,)}, r"unknown transcription option\(s\) \['temperatures'\]"),
        ({"temperature": (0.0, 3.0)}, r"numbers in \[0, 2\], got 3.0"),
        ({"temperature": "warm"}, "temperature must be a number or a sequence"),
        ({"logprob_threshold": float("inf")}, "logprob_threshold must be finite"),
        ({"sampling_params": SamplingParams(n=2)}, "n=1"),
        ({"prompt": 5}, "prompt must be a string"),
    ],
)
def test_bad_options_fail_before_any_request(whisper_config, options, message) -> None:
    engine = scripted(whisper_config, lambda call: Reply([]))
    with pytest.raises(ValueError, match=message):
        Transcriber(engine).transcribe((noise(2), SR), language="en", **options)
    assert engine.calls == []


def test_words_of_each_window_are_offset_by_its_seek(aligned_config) -> None:
    """Each window's token times (from its own start) are taken by its segments in order: the
    text cut by the window edge is timed again by the window that decodes it whole."""
    tok = aligned_config[1]
    a, b, c, d = (words(tok, f" Word {w}.") for w in ("one", "two", "three", "four"))

    def timed(*texts: list[int], step: float) -> list[float]:
        return [step * k for k in range(sum(len(t) for t in texts) + 1)]

    replies = [
        Reply(
            [ts(0), *a, ts(11), ts(11), *b, ts(22), ts(22), *c],
            token_times=timed(a, b, c, step=1.0),
        ),
        Reply([ts(0), *c, ts(5), ts(5), *d, ts(9)], token_times=timed(c, d, step=0.5)),
    ]
    engine = scripted(aligned_config, in_order(replies))
    (result,) = Transcriber(engine).transcribe((noise(40), SR), language="en", word_timestamps=True)
    assert all(call.params.word_timestamps for call in engine.calls)
    assert [s.seek for s in result.segments] == [0, 0, 2200, 2200]
    la, lb, lc, ld = (len(t) for t in (a, b, c, d))
    spans = [(s.words[0].start, s.words[-1].end) for s in result.segments]
    assert spans == [
        (0.0, la),
        (la, la + lb),
        (22.0, 22.0 + 0.5 * lc),  # window 2 starts at 22 s; its tokens are 0.5 s long
        (22.0 + 0.5 * lc, 22.0 + 0.5 * (lc + ld)),
    ]
    for segment in result.segments:
        assert "".join(w.word for w in segment.words) == segment.text
    assert result.words == [w for s in result.segments for w in s.words]


def test_a_window_without_token_times_fails_the_transcription(aligned_config) -> None:
    tok = aligned_config[1]
    engine = scripted(aligned_config, lambda call: Reply([ts(0), *words(tok, " Hi."), ts(1)]))
    with pytest.raises(TranscriptionError, match="without word timings"):
        Transcriber(engine).transcribe((noise(2), SR), language="en", word_timestamps=True)
