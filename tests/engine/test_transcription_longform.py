"""Long-form transcription with the real whisper-base against transformers' long-form
`generate` (fp32, timestamps, previous-text conditioning, the same fallback thresholds) on a
75 s file where speech crosses every 30 s window edge: the JFK clip six times, then both
LibriSpeech clips, back to back. One module fixture computes both sides once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tests.utils import ASSETS, WHISPER_BASE
from v1 import LLM
from v1.audio import load_audio

AUDIO = ASSETS / "audio"
CLIPS = ["jfk.flac"] * 6 + ["librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
SR = 16_000
FALLBACK = {
    "temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
    "compression_ratio_threshold": 2.4,
    "logprob_threshold": -1.0,
    "no_speech_threshold": 0.6,
}
pytestmark = [
    pytest.mark.skipif(
        not WHISPER_BASE.is_dir() or not AUDIO.is_dir(),
        reason=f"needs the real whisper-base folder and clips under {ASSETS}",
    ),
    pytest.mark.slow,  # ~35 s of CPU: both long-form decodings of 75 s of speech
]


@dataclass(frozen=True)
class Side:
    text: str
    segments: list[tuple[float, float, str]]


@dataclass(frozen=True)
class Runs:
    duration: float
    references: list[str]
    ours: Any
    theirs: Side


def transformers_long_form(audio: np.ndarray) -> Side:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(str(WHISPER_BASE))
    model = WhisperForConditionalGeneration.from_pretrained(
        str(WHISPER_BASE), dtype=torch.float32
    ).eval()
    inputs = processor(
        audio,
        sampling_rate=SR,
        return_tensors="pt",
        truncation=False,
        padding="longest",
        return_attention_mask=True,
    )
    with torch.no_grad():
        out = model.generate(
            inputs.input_features,
            attention_mask=inputs.attention_mask,
            language="en",
            task="transcribe",
            return_timestamps=True,
            condition_on_prev_tokens=True,
            return_segments=True,
            **FALLBACK,
        )
    decode = processor.tokenizer.decode
    segments = [
        (float(s["start"]), float(s["end"]), decode(s["tokens"], skip_special_tokens=True))
        for s in out["segments"][0]
    ]
    return Side(decode(out["sequences"][0], skip_special_tokens=True), segments)


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode steps are small ops; the suite shares the cores
    try:
        audio = np.concatenate([load_audio(AUDIO / name) for name in CLIPS])
        references = [(AUDIO / name).with_suffix(".txt").read_text().strip() for name in CLIPS]
        with LLM(str(WHISPER_BASE), device="cpu", multiprocess=False) as llm:
            (ours,) = llm.transcribe((audio, SR), language="en", timestamps=True, **FALLBACK)
        yield Runs(audio.shape[0] / SR, references, ours, transformers_long_form(audio))
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _normalizer() -> Any:
    """Whisper's English normalizer with whisper-base's spelling table (as WER is scored)."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    return EnglishTextNormalizer(json.loads((WHISPER_BASE / "normalizer.json").read_text()))


def normalized_words(text: str) -> list[str]:
    return _normalizer()(text).split()


def word_error_rate(reference: list[str], hypothesis: list[str]) -> float:
    previous = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, start=1):
        current = [i]
        for j, hyp_word in enumerate(hypothesis, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word))
            )
        previous = current
    return previous[-1] / len(reference)


def test_speech_across_every_window_edge_is_kept_in_order(runs: Runs) -> None:
    result = runs.ours
    assert result.duration == pytest.approx(runs.duration) and runs.duration > 75.0
    for edge in (30.0, 60.0):  # speech crosses the fixed window edges
        assert any(s.start < edge < s.end for s in result.segments), edge
    got = normalized_words(result.text)
    position = 0
    for reference in runs.references:  # every sentence, in order
        want = normalized_words(reference)
        found = next((i for i in range(position, len(got)) if got[i : i + len(want)] == want), None)
        assert found is not None, (reference, got[position:])
        position = found + len(want)
    assert position == len(got)
    last_end = 0.0
    for segment in result.segments:
        assert last_end <= segment.start < segment.end <= result.duration, segment
        last_end = segment.end
    assert result.text == "".join(s.text for s in result.segments)


def test_text_and_segments_equal_transformers_long_form(runs: Runs) -> None:
    result, theirs = runs.ours, runs.theirs
    assert result.text == theirs.text
    # Their last segment may end past the audio (the model's timestamp); ours stops at its end.
    want = [(start, min(end, runs.duration), text) for start, end, text in theirs.segments]
    got = [(s.start, s.end, s.text) for s in result.segments]
    assert len(got) == len(want) == len(runs.references)
    for ours, reference in zip(got, want, strict=True):
        assert ours[0] == pytest.approx(reference[0], abs=1e-6)
        assert ours[1] == pytest.approx(reference[1], abs=1e-6)
        assert ours[2] == reference[2]
    assert all(s.temperature == 0.0 for s in result.segments)


def test_word_error_rate_is_no_worse_than_transformers(runs: Runs) -> None:
    reference = normalized_words(" ".join(runs.references))
    ours = word_error_rate(reference, normalized_words(runs.ours.text))
    theirs = word_error_rate(reference, normalized_words(runs.theirs.text))
    assert ours <= theirs
    assert ours < 0.1
