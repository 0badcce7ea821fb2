"""Whisper end to end: WhisperInputBuilder prompts and validation, the Transcriber over LLMEngine
(real whisper-base: exact tokens, language detection sharing the encoder run, translate; a tiny
random model: windows in sequence) and over AsyncLLM, encoder runs, and bad audio. Long-form
against transformers: test_transcription_longform.py; the plan's rules: test_transcription_plan.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from blake3 import blake3

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, make_tiny_whisper_dir, needs_assets
from v1 import LLM
from v1.audio import AudioError, load_audio
from v1.engine.inputs.whisper import WhisperInputBuilder, WhisperInputError
from v1.engine.transcription import Transcriber, TranscriptionResult
from v1.sampling_params import SamplingParams

AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
SR = 16_000
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]
ENGINE_ARGS = dict(
    device="cpu",
    multiprocess=False,
    max_num_encoder_input_tokens=6 * 1500,
    encoder_cache_size=12 * 1500,
)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return json.loads((AUDIO / "expected_whisper_base.json").read_text())


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    return {name: load_audio(AUDIO / name) for name in CLIPS}


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(str(WHISPER_BASE), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper"))


@pytest.fixture(scope="module")
def tiny_en_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny_whisper_en"), layout="english_only")


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir: str) -> LLM:
    return LLM(tiny_dir, **ENGINE_ARGS)


def stats(llm: LLM) -> dict[str, Any]:
    return llm.llm_engine.get_stats()


def builder_for(llm: LLM) -> WhisperInputBuilder:
    engine = llm.llm_engine
    return WhisperInputBuilder(engine.model_config, engine.tokenizer)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower().replace("'", "")).split()


def assert_monotonic(result: TranscriptionResult) -> None:
    last_end = 0.0
    for seg in result.segments:
        assert last_end <= seg.start <= seg.end <= result.duration + 1e-6, seg
        last_end = seg.end


class RecordingEngine:
    """Wraps an LLMEngine and records every request the Transcriber adds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.added: list[tuple[str, dict[str, Any], SamplingParams]] = []

    def add_processed_request(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams,
        core_requests: Any,
        *,
        lazy_logprobs: bool = False,
    ) -> None:
        self.added.append((request_id, prompt, params))
        self.engine.add_processed_request(
            request_id, prompt, params, core_requests, lazy_logprobs=lazy_logprobs
        )

    def step(self) -> list[Any]:
        return self.engine.step()

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)

    def batched_adds(self) -> Any:
        return self.engine.batched_adds()


class CountingEngine(RecordingEngine):
    """A RecordingEngine with the engine's config that counts the requests added before each
    step."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.config = engine.config
        self.adds_at_step: list[int] = []

    def step(self) -> list[Any]:
        self.adds_at_step.append(len(self.added))
        return super().step()


# ---- WhisperInputBuilder ----


def test_decoder_prompts_languages_and_sampling_defaults(tiny_llm: LLM) -> None:
    builder = builder_for(tiny_llm)
    tokens = builder.tokens
    assert builder.decoder_prompt(language="en") == [50258, 50259, 50359, 50363]
    assert builder.decoder_prompt(language="English", task="translate", timestamps=True) == [
        50258,
        50259,
        50358,
    ]
    assert builder.decoder_prompt(language="<|fr|>")[1] == tokens.language_ids["fr"] == 50265
    assert builder.decoder_prompt(language="german")[1] == tokens.language_ids["de"]
    hello = builder.text_prompt_ids("  hello there ")
    assert hello == builder.tokenizer(" hello there", add_special_tokens=False)["input_ids"]
    assert builder.decoder_prompt(language="en", previous_text_ids=hello) == [
        50361,
        *hello,
        50258,
        50259,
        50359,
        50363,
    ]
    long_prompt = builder.decoder_prompt(language="en", previous_text_ids=list(range(300)))
    assert long_prompt[1:224] == list(range(77, 300))  # the last 223 previous tokens

    wave = np.linspace(-0.5, 0.5, 3 * SR, dtype=np.float32)
    request = builder.build(
        "b",
        {"prompt": "hello there", "multi_modal_data": {"audio": (wave, SR)}},
        SamplingParams(max_tokens=None),
    )
    assert request.prompt_token_ids == [50361, *hello, 50258, 50259, 50359, 50363]
    params = request.sampling_params
    gc = json.loads((WHISPER_BASE / "generation_config.json").read_text())
    assert params.suppress_tokens == gc["suppress_tokens"]
    assert params.begin_suppress_tokens == [220, 50257]
    assert params.max_tokens == 448 - len(request.prompt_token_ids)
    assert request.eos_token_id == 50257
    enc = request.encoder_input
    assert enc.num_encoder_tokens == 1500 and enc.audio.dtype == np.float32
    assert enc.content_hash == blake3(wave.tobytes()).hexdigest()
    # Explicit params and verbatim decoder prompts are kept as given.
    verbatim = "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    request = builder.build(
        "v",
        {"prompt": verbatim, "multi_modal_data": {"audio": (wave, SR)}},
        SamplingParams(max_tokens=7, suppress_tokens=[5]),
    )
    assert request.prompt_token_ids == [50258, 50265, 50358, 50363]
    assert (request.sampling_params.max_tokens, request.sampling_params.suppress_tokens) == (7, [5])


def test_builder_rejects_bad_languages_tasks_and_prompts(tiny_llm: LLM, tiny_en_dir: str) -> None:
    builder = builder_for(tiny_llm)
    with pytest.raises(WhisperInputError, match="unsupported language 'klingon'") as info:
        builder.decoder_prompt(language="klingon")
    assert len(str(info.value)) < 250
    with pytest.raises(WhisperInputError, match="'transcribe' or 'translate'"):
        builder.decoder_prompt(language="en", task="summarize")
    wave = np.zeros(SR, dtype=np.float32)
    with pytest.raises(WhisperInputError, match="needs audio"):
        builder.build("x", {"prompt": "hi"}, SamplingParams())
    with pytest.raises(AudioError, match="longer than one 30 s"):
        builder.build(
            "x", {"multi_modal_data": {"audio": (np.zeros(31 * SR), SR)}}, SamplingParams()
        )
    with pytest.raises(WhisperInputError, match="unexpected Whisper prompt keys"):
        builder.build(
            "x", {"multi_modal_data": {"audio": (wave, SR)}, "lang": "en"}, SamplingParams()
        )

    from v1.config import ModelConfig
    from v1.tokenizer import get_tokenizer

    en_config = ModelConfig(tiny_en_dir)
    en_builder = WhisperInputBuilder(en_config, get_tokenizer(en_config))
    assert not en_builder.tokens.multilingual
    assert en_builder.decoder_prompt(language="english") == [50257, 50362]
    assert en_builder.decoder_prompt(timestamps=True) == [50257]
    with pytest.raises(WhisperInputError, match="English-only"):
        en_builder.decoder_prompt(language="fr")
    with pytest.raises(WhisperInputError, match="English-only .* cannot translate"):
        en_builder.decoder_prompt(task="translate")


# ---- real whisper-base ----


def test_real_clips_detect_english_and_give_the_expected_tokens(
    real_llm: LLM, expected: dict[str, Any]
) -> None:
    """Detection + transcription of three clips in one batch: six requests, three encoder runs
    (each detection request and its transcription share one encoder output)."""
    before = stats(real_llm)["num_encoder_runs"]
    recorder = RecordingEngine(real_llm.llm_engine)
    results = Transcriber(recorder).transcribe([str(AUDIO / name) for name in CLIPS])
    assert stats(real_llm)["num_encoder_runs"] - before == len(CLIPS)
    detect = [params for rid, _, params in recorder.added if rid.endswith("-language")]
    assert len(detect) == len(CLIPS) and all(p.max_tokens == 1 for p in detect)
    assert len(recorder.added) == 2 * len(CLIPS)
    for name, result in zip(CLIPS, results, strict=True):
        want = expected[name]
        assert result.language == "en"
        assert result.text == want["text"]
        assert result.duration == pytest.approx(want["duration_s"], abs=0.01)
        (segment,) = result.segments
        assert segment.tokens == want["token_ids"]
        assert (segment.start, segment.end) == (0.0, pytest.approx(want["duration_s"], abs=0.01))
        assert -1.0 < segment.avg_logprob < 0.0
        assert segment.compression_ratio > 0.5
    stats_after = stats(real_llm)
    assert stats_after["num_kv_requests"] == 0 and stats_after["num_used_blocks"] == 0


def test_real_generate_with_audio_prompt_and_translate(
    real_llm: LLM, clips: dict[str, np.ndarray], expected: dict[str, Any]
) -> None:
    name = "librispeech/test_audio_0.flac"
    prompt = {"prompt": "", "multi_modal_data": {"audio": (clips[name], SR)}, "language": "en"}
    (out,) = real_llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False
    )
    assert out.outputs[0].token_ids == expected[name]["token_ids"] + [50257]
    assert out.outputs[0].text == expected[name]["text"]

    recorder = RecordingEngine(real_llm.llm_engine)
    (result,) = Transcriber(recorder).transcribe((clips[name], SR), language="en", task="translate")
    assert recorder.added[0][1]["prompt_token_ids"] == [50258, 50259, 50358, 50363]
    assert "universe" in words(result.text)


def test_real_no_speech_prob_reaches_the_segments(
    real_llm: LLM, clips: dict[str, np.ndarray]
) -> None:
    (result,) = real_llm.transcribe((clips["jfk.flac"], SR), language="en")
    # transformers: softmax(logits at <|startoftranscript|>)[<|nocaptions|>] = 0.0443757
    assert result.segments[0].no_speech_prob == pytest.approx(0.0443757, abs=1e-4)


# ---- tiny random Whisper ----


def test_long_audio_runs_window_after_window_with_the_text_so_far(tiny_llm: LLM) -> None:
    """A real (tiny, random) engine: each window waits for the one before, starts at a frame
    offset no earlier than the previous window's, and is prompted with the prompt text plus
    everything decoded before it (the seek and fallback rules have their own tests)."""
    rng = np.random.default_rng(5)
    audio = (0.1 * rng.standard_normal(65 * SR)).astype(np.float32)
    recorder = RecordingEngine(tiny_llm.llm_engine)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    (result,) = Transcriber(recorder).transcribe(
        (audio, SR), language="en", prompt="hello there", sampling_params=params, temperature=0.0
    )
    hello = builder_for(tiny_llm).text_prompt_ids("hello there")
    prompts = [p["prompt_token_ids"] for _, p, _ in recorder.added]
    assert len(prompts) >= 3 and prompts[0] == [50361, *hello, 50258, 50259, 50359]
    history = [50361, *hello]
    for prompt in prompts[1:]:
        assert prompt[: len(history)] == history and prompt[-3:] == [50258, 50259, 50359]
        assert len(prompt) > len(history) + 3  # the previous window's tokens were added
        history = prompt[:-3]
    offsets = []
    for _, prompt, params_ in recorder.added:
        window = prompt["multi_modal_data"]["audio"].samples
        assert params_.whisper_timestamps
        starts = np.flatnonzero(audio == window[0])
        frames = [k for k in starts if np.array_equal(audio[k : k + len(window)], window)]
        assert frames and frames[0] % 160 == 0  # a frame-aligned slice of the input
        offsets.append(int(frames[0]))
    assert len(offsets) == len(prompts) and offsets[0] == 0
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert_monotonic(result)


def test_same_audio_twice_runs_the_encoder_once(tiny_llm: LLM) -> None:
    rng = np.random.default_rng(6)
    wave = (0.1 * rng.standard_normal(4 * SR)).astype(np.float32)
    transcriber = Transcriber(tiny_llm.llm_engine)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = stats(tiny_llm)["num_encoder_runs"]
    # Language detection too: four requests over one encoder output.
    first, second = transcriber.transcribe(
        [(wave, SR), (wave.copy(), SR)], sampling_params=params, temperature=0.0
    )
    assert stats(tiny_llm)["num_encoder_runs"] - before == 1
    assert first.segments[0].tokens == second.segments[0].tokens
    assert first.language == second.language


def _wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_bad_audio_fails_clearly_and_the_engine_keeps_serving(
    tiny_llm: LLM, tmp_path: Path
) -> None:
    good = _wav_bytes(np.zeros(SR, dtype=np.int16), SR)
    zero_rate = bytearray(good)
    zero_rate[24:28] = (0).to_bytes(4, "little")  # fmt chunk: sample rate
    nan = np.zeros(SR, dtype=np.float32)
    nan[100] = np.nan
    too_long = tmp_path / "long.wav"  # just over the 3 h cap, at 1 kHz 8-bit
    sf.write(too_long, np.zeros(3 * 3600 * 1000 + 10, dtype=np.int16), 1000, subtype="PCM_U8")
    flac = (AUDIO / "jfk.flac").read_bytes()
    cases = {
        "empty": (b"", "empty"),
        "one sample": ((np.zeros(1, dtype=np.float32), SR), "too short"),
        "not audio": (b"this is not audio at all " * 40, "could not decode audio"),
        "truncated flac": (flac[: len(flac) // 3], "corrupt or truncated"),
        "truncated wav": (good[: len(good) // 2], "truncated WAV"),
        "nan samples": ((nan, SR), "NaN"),
        "0 Hz header": (bytes(zero_rate), "sample rate 0 Hz"),
        "past the cap": (str(too_long), "too long"),
        "missing file": (str(tmp_path / "nope.wav"), "not found"),
    }
    transcriber = Transcriber(tiny_llm.llm_engine)
    before = stats(tiny_llm)
    for name, (source, message) in cases.items():
        with pytest.raises(AudioError, match=message) as info:
            transcriber.transcribe([(np.zeros(SR, dtype=np.float32), SR), source])
        assert "audio input 1" in str(info.value), name
        with pytest.raises(ValueError, match=message):
            tiny_llm.generate({"prompt": "", "multi_modal_data": {"audio": source}}, use_tqdm=False)
    after = stats(tiny_llm)
    assert after["num_encoder_runs"] == before["num_encoder_runs"], "nothing ran"
    assert after["num_requests"] == 0 and after["num_kv_requests"] == 0
    # The engine still serves, and frees everything.
    (result,) = transcriber.transcribe(
        good, language="en", sampling_params=SamplingParams(max_tokens=4)
    )
    assert result.duration == pytest.approx(1.0) and result.language == "en"
    after = stats(tiny_llm)
    assert after["num_kv_requests"] == 0 and after["num_used_blocks"] == 0


def test_async_transcription_matches_the_synchronous_one(tiny_dir: str, tiny_llm: LLM) -> None:
    from v1.engine.async_llm import AsyncLLM

    rng = np.random.default_rng(7)
    waves = [(0.1 * rng.standard_normal(int(s * SR))).astype(np.float32) for s in (2.0, 35.0)]
    audio = [(w, SR) for w in waves]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = Transcriber(tiny_llm.llm_engine).transcribe(
        audio, sampling_params=params, temperature=0.0
    )

    async def run() -> list[TranscriptionResult]:
        args = {k: v for k, v in ENGINE_ARGS.items() if k != "multiprocess"}
        llm = AsyncLLM(tiny_dir, **args)
        try:
            return await llm.transcribe(audio, params, request_id="async-tx", temperature=0.0)
        finally:
            llm.shutdown()

    results = asyncio.run(run())
    assert [r.language for r in results] == [r.language for r in expected]
    assert [[s.tokens for s in r.segments] for r in results] == [
        [s.tokens for s in r.segments] for r in expected
    ]
    assert [len(r.segments) for r in results] == [1, 2]  # 35 s: two windows


def test_bad_audio_paths_are_named_in_the_error(tiny_llm: LLM, tmp_path: Path) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not audio at all " * 40)
    silence = (np.zeros(SR, dtype=np.float32), SR)
    with pytest.raises(AudioError) as info:
        tiny_llm.transcribe([silence, str(bad)])
    assert str(info.value) == (
        f"audio input 1: {bad}: could not decode audio: not a supported audio format, or "
        "corrupt (libsndfile: Format not recognised; ffmpeg: Invalid data found when processing "
        "input)"
    )
    with pytest.raises(AudioError) as info:
        tiny_llm.transcribe(str(tmp_path / "nope.wav"))
    assert str(info.value) == f"audio file not found: '{tmp_path / 'nope.wav'}'"


def test_progress_bar_for_batches_and_long_audio(
    tiny_llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(8)
    short = (0.1 * rng.standard_normal(2 * SR)).astype(np.float32)
    options = dict(language="en", sampling_params=SamplingParams(max_tokens=3), temperature=0.0)
    tiny_llm.transcribe((short, SR), **options)
    assert "Transcribing" not in capfd.readouterr().err  # one short clip: no bar
    tiny_llm.transcribe([(short, SR), (short, SR)], **options)
    err = capfd.readouterr().err
    assert "Transcribing: 100%" in err and "4.0/4.0 s audio" in err and "RTFx" in err
    tiny_llm.transcribe((np.tile(short, 16), SR), **options)  # 32 s: two windows
    assert "32.0/32.0 s audio" in capfd.readouterr().err
    tiny_llm.transcribe([(short, SR), (short, SR)], use_tqdm=False, **options)
    assert "Transcribing" not in capfd.readouterr().err


def test_files_start_a_step_budget_at_a_time_with_the_same_results(tiny_llm: LLM) -> None:
    """The device starts on the first windows while the host prepares the next files: one
    step's encoder budget of files (6 windows here) and one more before the first engine step
    (a request left unscheduled, so the pipelined engine launches a step ahead), then at most
    one step's budget before each step."""
    rng = np.random.default_rng(9)
    waves = [(0.1 * rng.standard_normal(3 * SR)).astype(np.float32) for _ in range(14)]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    engine = CountingEngine(tiny_llm.llm_engine)
    transcriber = Transcriber(engine)
    assert transcriber.files_per_step == 6
    chunked = transcriber.transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    assert engine.adds_at_step[:3] == [7, 13, 14]
    transcriber.files_per_step = len(waves)  # every file before the first step
    whole = transcriber.transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    assert [r.text for r in chunked] == [r.text for r in whole]
    assert [s.tokens for r in chunked for s in r.segments] == [
        s.tokens for r in whole for s in r.segments
    ]


def test_a_core_that_runs_ahead_gets_two_step_budgets_queued(tiny_llm: LLM) -> None:
    """A core in its own process steps without waiting for the frontend: the frontend keeps
    two steps' encoder budget of windows queued without an output (sent in a second message
    after the first budget), and every window is decoded as with no lead."""
    rng = np.random.default_rng(11)
    waves = [(0.1 * rng.standard_normal(3 * SR)).astype(np.float32) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    class AheadEngine(CountingEngine):
        core_runs_ahead = True

    engine = AheadEngine(tiny_llm.llm_engine)
    ahead = Transcriber(engine)
    assert ahead.core_lead == 2 * ahead.files_per_step == 12
    assert Transcriber(RecordingEngine(tiny_llm.llm_engine)).core_lead == 0
    results = ahead.transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    assert engine.adds_at_step[0] == 12  # 7 (a budget + one), then 5 more in a second message
    assert max(engine.adds_at_step) == 20
    plain = Transcriber(tiny_llm.llm_engine).transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    assert [r.text for r in results] == [r.text for r in plain]
    assert [s.tokens for r in results for s in r.segments] == [
        s.tokens for r in plain for s in r.segments
    ]


def test_a_core_that_runs_ahead_starts_on_a_few_files_sent_alone(tiny_llm: LLM) -> None:
    """For a core in its own process the run's first message holds `first_files` files alone
    (FIRST_FILES per core by default): the core's first encoder step starts on them while the
    rest of the first budget, then the lead's top-up, follow in messages of their own; every
    window is decoded as with one first message."""
    from contextlib import contextmanager

    from v1.engine.transcription.offline import FIRST_FILES

    rng = np.random.default_rng(12)
    waves = [(0.1 * rng.standard_normal(3 * SR)).astype(np.float32) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    class MessageEngine(CountingEngine):
        core_runs_ahead = True

        def __init__(self, engine: Any) -> None:
            super().__init__(engine)
            self.messages: list[int] = []

        @contextmanager
        def batched_adds(self) -> Any:
            before = len(self.added)
            with self.engine.batched_adds():
                yield
            if len(self.added) > before:
                self.messages.append(len(self.added) - before)

    engine = MessageEngine(tiny_llm.llm_engine)
    ahead = Transcriber(engine)
    assert ahead.first_files == FIRST_FILES == 8  # not fewer than a budget + 1 (7) here
    assert Transcriber(RecordingEngine(tiny_llm.llm_engine)).first_files > 1000  # this process
    ahead.first_files = 2
    results = ahead.transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    # 2 alone, the other 5 of the first budget (6 + 1), then up to the lead of 12 queued.
    assert engine.messages[:3] == [2, 5, 5]
    assert engine.adds_at_step[0] == 12
    plain = Transcriber(tiny_llm.llm_engine).transcribe(
        [(w, SR) for w in waves], sampling_params=params, language="en", temperature=0.0
    )
    assert [s.tokens for r in results for s in r.segments] == [
        s.tokens for r in plain for s in r.segments
    ]


def test_data_parallel_engines_admit_a_budget_of_files_per_core(tiny_llm: LLM) -> None:
    """Under data_parallel_size=N each core steps on its own: N step budgets of files start
    between two engine steps, and twice max_num_seqs per core may be active."""
    import dataclasses

    config = tiny_llm.llm_engine.config
    one = Transcriber(tiny_llm.llm_engine)
    engine = RecordingEngine(tiny_llm.llm_engine)
    engine.config = dataclasses.replace(  # type: ignore[attr-defined]
        config,
        parallel_config=dataclasses.replace(config.parallel_config, data_parallel_size=2),
    )
    two = Transcriber(engine)
    assert two.files_per_step == 2 * one.files_per_step
    assert two.max_active_files == 2 * one.max_active_files
    assert two.num_cores == 2


def test_many_inputs_load_on_threads_and_report_the_first_bad_one(tmp_path: Path) -> None:
    """Past a few inputs `load_audio_inputs` loads on threads: the waveforms keep input order
    (arrays at 16 kHz come back as views, no copy) and, of several bad inputs, the error names
    the first in input order."""
    from v1.engine.transcription import loading as transcription

    rng = np.random.default_rng(3)
    waves = [rng.standard_normal(SR + i).astype(np.float32) for i in range(20)]
    loaded = transcription.load_audio_inputs([(w, SR) for w in waves])
    assert len(waves) >= transcription._PARALLEL_LOAD_MIN
    assert all(
        np.shares_memory(a, w) and a.shape == w.shape for a, w in zip(loaded, waves, strict=True)
    )
    nan = waves[5].copy()
    nan[7] = np.nan
    sources = [(w, SR) for w in waves]
    sources[5] = (nan, SR)
    sources[12] = str(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match=r"^audio input 5: audio contains NaN"):
        transcription.load_audio_inputs(sources)
