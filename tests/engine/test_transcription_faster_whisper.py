"""faster-whisper-style transcription with the real whisper-base on real speech (CPU): VAD
filtering on the original timeline, batched VAD chunks of one and many files, word timestamps
with beam search and best_of (every word with a probability), and the decoding options that
change the text (prefix, suppress_tokens, repetition_penalty, no_repeat_ngram_size,
max_initial_timestamp).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, needs_assets
from v1 import LLM
from v1.audio import load_audio

AUDIO = ASSETS / "audio"
SR = 16_000
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]
JFK = " And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(str(WHISPER_BASE), device="cpu", multiprocess=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    names = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
    return {name.split("/")[-1].split(".")[0]: load_audio(AUDIO / name) for name in names}


@pytest.fixture(scope="module")
def references() -> dict[str, str]:
    return {
        "jfk": (AUDIO / "jfk.txt").read_text().strip(),
        "test_audio_0": (AUDIO / "librispeech/test_audio_0.txt").read_text().strip(),
        "test_audio_1": (AUDIO / "librispeech/test_audio_1.txt").read_text().strip(),
    }


@functools.cache
def _normalizer() -> Any:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    return EnglishTextNormalizer(json.loads((WHISPER_BASE / "normalizer.json").read_text()))


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = _normalizer()(reference).split(), _normalizer()(hypothesis).split()
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        current = [i]
        for j, h in enumerate(hyp, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1] / len(ref)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), dtype=np.float32)


def test_vad_filter_skips_silence_and_keeps_the_original_timeline(llm, clips, references) -> None:
    jfk, a0 = clips["jfk"], clips["test_audio_0"]
    audio = np.concatenate([silence(6), jfk, silence(6), a0, silence(6)])
    second = (6 + jfk.size / SR + 6) * 1.0  # where the second clip starts
    (result,) = llm.transcribe(
        (audio, SR), language="en", vad_filter=True, word_timestamps=True, use_tqdm=False
    )
    assert result.duration == pytest.approx(audio.size / SR)
    assert wer(references["jfk"] + " " + references["test_audio_0"], result.text) < 0.15
    # Nothing before the speech: the first word starts within the VAD pad of 6 s.
    assert result.segments[0].start >= 5.5 and 5.5 <= result.words[0].start <= 6.8
    # The second clip's words sit on its own place in the recording, not 6 s early.
    man = next(w for w in result.words if w.word.strip().lower() == "man")
    assert second <= man.start <= second + 1.5
    times = [t for w in result.words for t in (w.start, w.end)]
    assert times == sorted(times) and times[-1] <= audio.size / SR
    # Silence only: no request text, no segments.
    (empty,) = llm.transcribe((silence(5), SR), language="en", vad_filter=True, use_tqdm=False)
    assert empty.segments == [] and empty.text == ""


@pytest.mark.slow  # ~25 s on a loaded 2-core box
def test_batched_chunks_of_one_and_many_files(llm, clips, references) -> None:
    """A 31 s silence splits the speech into two VAD chunks: each is one segment (faster-
    whisper's batched pipeline), placed where its speech is; the silence is not decoded."""
    a0, jfk, a1 = clips["test_audio_0"], clips["jfk"], clips["test_audio_1"]
    audio = np.concatenate([a0, silence(31), jfk, silence(2.5), a1, silence(1)])
    jfk_start = (a0.size + 31 * SR) / SR
    reference = " ".join(references[n] for n in ("test_audio_0", "jfk", "test_audio_1"))
    results = llm.transcribe([(audio, SR), (a1, SR)], batch_size=4, vad_filter=True, use_tqdm=False)
    long, short = results
    assert long.language == "en" and long.language_probability > 0.5
    assert wer(reference, long.text) < 0.15
    assert wer(references["test_audio_1"], short.text) < 0.15
    assert [s.id for s in long.segments] == [0, 1]
    first, second = long.segments
    assert first.start < 1.0 and a0.size / SR - 0.5 < first.end < a0.size / SR + 1.0
    assert abs(second.start - jfk_start) < 1.0 and second.end <= audio.size / SR
    assert "universe" in first.text and "fellow" in second.text and "Nor" in second.text
    # timestamps=True: timed segments inside each chunk, still on the file's clock.
    (timed,) = llm.transcribe(
        (audio, SR),
        batch_size=4,
        vad_filter=True,
        timestamps=True,
        language="en",
        use_tqdm=False,
    )
    starts = [s.start for s in timed.segments]
    assert len(starts) >= 3 and starts == sorted(starts)
    assert all(s.start >= jfk_start - 1.0 for s in timed.segments if "fellow" in s.text)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"beam_size": 2}, marks=pytest.mark.slow),  # CPU beam steps: ~20-60 s
        {"best_of": 2, "temperature": 0.4},
    ],
    ids=["beam", "best_of"],
)
def test_word_timestamps_with_beam_search_and_best_of(llm, clips, options) -> None:
    audio = clips["test_audio_0"]
    (result,) = llm.transcribe(
        (audio, SR), language="en", word_timestamps=True, use_tqdm=False, **options
    )
    assert result.words and "".join(w.word for w in result.words) == result.text
    times = [t for w in result.words for t in (w.start, w.end)]
    assert times == sorted(times) and times[0] >= 0.0 and times[-1] <= audio.size / SR
    assert times[-1] > times[0] + 1.0  # timed across the clip, not all at one instant
    assert all(0.0 < w.probability <= 1.0 for w in result.words)


def test_decoding_options_change_the_text(llm, clips) -> None:
    short = (clips["test_audio_0"], SR)

    def short_text(**options: Any) -> tuple[str, list[int]]:
        (r,) = llm.transcribe(short, language="en", use_tqdm=False, **options)
        return r.text, [t for s in r.segments for t in s.tokens]

    plain, _ = short_text()
    prefixed, _ = short_text(prefix="A woman said")
    assert prefixed.startswith(" A woman said") and plain.startswith(" A man said")
    universe = llm.get_tokenizer()(" universe", add_special_tokens=False)["input_ids"]
    assert "universe" in plain
    suppressed, tokens = short_text(suppress_tokens=[-1, universe[0]])
    assert universe[0] not in tokens and suppressed != plain
    jfk = (clips["jfk"], SR)

    def text(**options: Any) -> tuple[str, list[int]]:
        (r,) = llm.transcribe(jfk, language="en", use_tqdm=False, **options)
        return r.text, [t for s in r.segments for t in s.tokens]

    plain, tokens = text()
    assert plain == JFK
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    assert len(bigrams) > len(set(bigrams))  # "what you(r)", "can do for" come back
    no_repeat, tokens = text(no_repeat_ngram_size=2)
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    assert len(bigrams) == len(set(bigrams)) and no_repeat != plain
