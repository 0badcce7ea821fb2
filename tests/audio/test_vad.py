"""v1.audio.vad: Silero VAD on real speech (jfk.flac padded with silence), offline and streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from v1.audio import load_audio
from v1.audio.vad import (
    SAMPLE_RATE,
    SpeechMap,
    VadEvent,
    VadIterator,
    VadOptions,
    collect_speech,
    get_speech_timestamps,
    speech_probabilities,
)

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def padded_jfk(audio_dir: Path) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """5 s silence, jfk (11 s), 5 s silence, jfk, 5 s silence; and where each jfk copy lies."""
    jfk = np.asarray(load_audio(str(audio_dir / "jfk.flac")), dtype=np.float32)
    gap = np.zeros(5 * SR, dtype=np.float32)
    audio = np.concatenate([gap, jfk, gap, jfk, gap])
    first = (gap.size, gap.size + jfk.size)
    second = (first[1] + gap.size, first[1] + gap.size + jfk.size)
    return audio, [first, second]


def test_speech_found_inside_and_silence_skipped(padded_jfk) -> None:
    audio, truth = padded_jfk
    spans = get_speech_timestamps(audio, VadOptions())
    # faster-whisper's defaults: a 2 s silence ends a span, so each jfk copy is one span.
    assert len(spans) == 2
    for (s, e), (ts, te) in zip(spans, truth, strict=True):
        pad = int(0.4 * SR)
        assert ts - pad - 2 * 512 <= s < ts + 2 * SR  # starts near the speech, not in the gap
        assert te - 3 * SR < e <= te + pad + 512
    # Every span stays clear of the middle of the silent gaps.
    for s, e in spans:
        assert not (s <= truth[0][0] // 2 < e)
        assert not (s <= (truth[0][1] + truth[1][0]) // 2 < e)
    # And all of the silence outside the spans really is silence.
    covered = np.zeros(audio.size, bool)
    for s, e in spans:
        covered[s:e] = True
    assert np.abs(audio[~covered]).max() < 0.2


def test_options_change_the_spans(padded_jfk) -> None:
    audio, _ = padded_jfk
    default = get_speech_timestamps(audio)
    fine = get_speech_timestamps(audio, {"min_silence_duration_ms": 100, "speech_pad_ms": 30})
    assert len(fine) > len(default)  # jfk's pauses split it once 100 ms of silence suffices
    long_only = get_speech_timestamps(audio, VadOptions(min_speech_duration_ms=20_000))
    assert long_only == []
    capped = get_speech_timestamps(audio, VadOptions(max_speech_duration_s=4.0))
    assert all((e - s) <= 4.0 * SR for s, e in capped)
    assert len(capped) > len(default)


def test_silence_and_empty_audio_have_no_speech() -> None:
    assert get_speech_timestamps(np.zeros(3 * SR, np.float32)) == []
    assert get_speech_timestamps(np.zeros(0, np.float32)) == []


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown vad_parameters"):
        VadOptions.from_value({"treshold": 0.4})
    with pytest.raises(ValueError, match="threshold"):
        VadOptions(threshold=1.5)
    with pytest.raises(ValueError, match="neg_threshold"):
        VadOptions(threshold=0.5, neg_threshold=0.7)
    with pytest.raises(ValueError, match="1-D"):
        get_speech_timestamps(np.zeros((2, 100), np.float32))


def test_streaming_iterator_matches_offline(padded_jfk) -> None:
    audio, _ = padded_jfk
    offline = get_speech_timestamps(audio)
    it = VadIterator(VadOptions())
    events: list[VadEvent] = []
    # Odd chunk size: frames straddle chunks; state and context must carry over.
    for i in range(0, audio.size, 1234):
        events += it.feed(audio[i : i + 1234])
    events += it.flush()
    assert [e.kind for e in events] == ["start", "end"] * len(offline)
    pairs = [(events[i].sample, events[i + 1].sample) for i in range(0, len(events), 2)]
    assert pairs == offline
    # Same per-frame probabilities as the offline path.
    it2 = VadIterator()
    it2.feed(audio[: 10 * 512 + 100])
    assert it2.samples_seen == 10 * 512
    np.testing.assert_allclose(
        it2.last_probability, speech_probabilities(audio[: 10 * 512])[-1], rtol=1e-5, atol=1e-6
    )


def test_streaming_reports_start_before_the_end_of_speech(padded_jfk) -> None:
    audio, truth = padded_jfk
    it = VadIterator({"min_silence_duration_ms": 500, "speech_pad_ms": 0})
    first_start_fed_at = None
    fed = 0
    for i in range(0, truth[0][1], 1600):
        events = it.feed(audio[i : i + 1600])
        fed += min(1600, audio.size - i)
        if any(e.kind == "start" for e in events) and first_start_fed_at is None:
            first_start_fed_at = fed
    assert first_start_fed_at is not None and first_start_fed_at < truth[0][0] + 2 * SR
    it.reset()
    assert it.samples_seen == 0 and not it.in_speech


def test_speech_map_restores_original_times() -> None:
    spans = [(SR * 2, SR * 5), (SR * 10, SR * 12)]
    audio = np.arange(SR * 15, dtype=np.float32)
    speech = collect_speech(audio, spans)
    assert speech.size == 5 * SR
    assert speech[0] == 2 * SR and speech[3 * SR] == 10 * SR
    m = SpeechMap(spans)
    assert m.original_time(0.0) == 2.0
    assert m.original_time(1.5) == 3.5
    assert m.original_time(3.0, is_end=True) == 5.0  # end of the first span
    assert m.original_time(3.0) == 10.0  # start of the second span
    assert m.original_time(4.5) == 11.5
