"""Batched transcription (`batch_size`, `vad_filter`) while the VAD still runs: the engine gets
a file's first chunks before the VAD of its last piece has finished, the result is the one of
VAD-first decoding (real speech, real whisper-base), and the VAD threads create their
onnxruntime sessions once across calls."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, make_tiny_whisper_dir, needs_assets
from v1 import LLM
from v1.audio import load_audio, vad
from v1.engine.transcription import Transcriber, batching
from v1.sampling_params import SamplingParams

AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
SR = 16_000
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]
ENGINE_ARGS = dict(device="cpu", multiprocess=False)
SHORT = dict(sampling_params=SamplingParams(temperature=0.0, max_tokens=6), temperature=0.0)
"""Random weights decode a few tokens per chunk."""


@pytest.fixture(autouse=True)
def small_vad_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """~10 s VAD pieces or more, four waves over two threads: two minutes of speech are
    eight pieces."""
    stream = functools.partial(
        vad.SpanStream, workers=2, piece_frames=300, warmup_frames=200, waves=4
    )
    monkeypatch.setattr(batching, "SpanStream", stream)


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    """The three real clips back to back with 1-3 s silences, `seconds` long."""
    clips = [load_audio(AUDIO / name) for name in CLIPS]
    rng = np.random.default_rng(seed)
    pieces, total, k = [], 0, 0
    while total < seconds * SR:
        pieces += [clips[k % 3], np.zeros(int(rng.uniform(1.0, 3.0) * SR), np.float32)]
        total += pieces[-2].size + pieces[-1].size
        k += 1
    return np.concatenate(pieces)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    with LLM(make_tiny_whisper_dir(tmp_path_factory.mktemp("tiny")), **ENGINE_ARGS) as llm:
        yield llm


class FirstRequestEngine:
    """An LLMEngine that sets `first_request` when the first window request reaches it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.first_request = threading.Event()

    def add_processed_request(self, *args: Any, **kwargs: Any) -> None:
        self.first_request.set()
        self.engine.add_processed_request(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "vad_first"])
def test_chunks_reach_the_engine_before_the_last_vad_piece_ends(
    tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch, pipelined: bool
) -> None:
    """The last VAD piece (of eight, ~15 s) waits until the engine has a request: pipelined,
    it gets one (the first chunks are settled by the pieces before); VAD first, it never does
    (the wait gives up and the run finishes VAD first)."""
    audio = speech(120)
    engine = FirstRequestEngine(tiny_llm.llm_engine)
    seen: list[bool] = []
    piece = vad._piece_probabilities

    def gated(samples: np.ndarray, lo: int, hi: int, warmup: int) -> np.ndarray:
        if hi * vad.FRAME_SAMPLES >= samples.size:  # the file's last piece
            seen.append(engine.first_request.wait(timeout=120 if pipelined else 3))
        return piece(samples, lo, hi, warmup)

    monkeypatch.setattr(vad, "_piece_probabilities", gated)
    transcriber = Transcriber(engine, pipeline_vad=pipelined)
    (result,) = transcriber.transcribe(
        (audio, SR), batch_size=2, vad_filter=True, language="en", **SHORT
    )
    assert seen == [pipelined]
    assert len(result.segments) >= 4  # 2 min of speech: at least four chunks of <= 30 s
    starts = [s.start for s in result.segments]
    assert starts == sorted(starts) and result.segments[-1].end <= audio.size / SR


def test_vad_sessions_are_created_once_across_two_transcribe_calls(
    tiny_llm: LLM, fresh_vad_threads: list[int]
) -> None:
    created = fresh_vad_threads
    audio = speech(70)
    first = tiny_llm.transcribe((audio, SR), batch_size=2, vad_filter=True, **SHORT)
    assert created[0] == 2  # several pieces on two threads: one session per thread
    second = tiny_llm.transcribe((audio, SR), batch_size=2, vad_filter=True, **SHORT)
    assert created[0] == 2
    assert second[0].text == first[0].text


@pytest.fixture(scope="module")
def whisper_base() -> Iterator[LLM]:
    with LLM(str(WHISPER_BASE), **ENGINE_ARGS) as llm:
        yield llm


def segment_key(segment: Any) -> tuple[Any, ...]:
    return (
        segment.id,
        segment.seek,
        segment.start,
        segment.end,
        segment.text,
        segment.tokens,
        segment.temperature,
        segment.language,
    )


def both_ways(llm: LLM, audio: list[Any], **options: Any) -> list[Any]:
    """Pipelined and VAD-first results of one call: the same segments, times, text and
    language; the pipelined ones."""
    results = {}
    for pipelined in (True, False):
        transcriber = Transcriber(llm.llm_engine, pipeline_vad=pipelined)
        results[pipelined] = transcriber.transcribe(audio, vad_filter=True, **options)
    for pipelined, vad_first in zip(results[True], results[False], strict=True):
        assert pipelined.text == vad_first.text and pipelined.language == vad_first.language
        assert [segment_key(s) for s in pipelined.segments] == [
            segment_key(s) for s in vad_first.segments
        ]
        # Probabilities come from logits of other batches: equal to float rounding.
        assert pipelined.language_probability == pytest.approx(
            vad_first.language_probability, abs=1e-5
        )
    return results[True]


def test_pipelined_result_is_the_vad_first_result(tiny_llm: LLM) -> None:
    """Two files of real speech (the first one's chunks settle before its VAD ends), the
    language detected per file, timed segments inside chunks."""
    audio = [(speech(120, seed=1), SR), (speech(20, seed=2), SR)]
    long, _ = both_ways(tiny_llm, audio, batch_size=3, timestamps=True, **SHORT)
    assert len(long.segments) >= 4
    starts = [s.start for s in long.segments]
    assert starts == sorted(starts) and long.segments[-1].end <= 120 + 3


@pytest.mark.slow  # ~55 s on a loaded 2-core box
def test_pipelined_whisper_base_result_is_the_vad_first_result(whisper_base: LLM) -> None:
    long, _ = both_ways(
        whisper_base, [(speech(60, seed=1), SR), (speech(15, seed=2), SR)], batch_size=3
    )
    assert long.language == "en" and len(long.segments) >= 2
    assert [s.id for s in long.segments] == list(range(len(long.segments)))
    assert "fellow Americans" in long.text and "universe" in long.text


def test_streamed_segments_come_in_file_order_while_vad_runs(tiny_llm: LLM) -> None:
    """`stream=True`: the chunks' segments come out file by file, chunk by chunk, as the
    result holds them (the same objects), though chunks are added while VAD runs."""
    audio = [(speech(120, seed=1), SR), (speech(20, seed=2), SR)]
    options = dict(batch_size=3, vad_filter=True, language="en", timestamps=True, **SHORT)
    stream = tiny_llm.transcribe(audio, stream=True, **options)
    streamed = [(stream.input_index, segment) for segment in stream]
    results = stream.results
    assert [s for i, s in streamed if i == 0] == results[0].segments
    assert [s for i, s in streamed if i == 1] == results[1].segments
    assert [i for i, _ in streamed] == sorted(i for i, _ in streamed)
    (again,) = tiny_llm.transcribe(audio[:1], **options)
    assert [segment_key(s) for s in again.segments] == [segment_key(s) for s in results[0].segments]
