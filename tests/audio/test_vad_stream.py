"""v1.audio.vad while the VAD still runs: `settled_spans` of a prefix of the probabilities are
final (random probabilities and options), `SpanStream` hands out, piece after piece, exactly
the spans of all the probabilities on real speech, and the VAD threads keep one onnxruntime
session each across calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from v1.audio import load_audio, vad
from v1.audio.vad import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    SpanStream,
    VadOptions,
    settled_spans,
    spans_from_probabilities,
    speech_probabilities,
)

SR = SAMPLE_RATE
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]
OPTIONS = [
    VadOptions(),
    VadOptions(max_speech_duration_s=30),  # batched transcription's chunking
    VadOptions(max_speech_duration_s=1.5, speech_pad_ms=100),  # many cuts at max speech
    VadOptions(min_silence_duration_ms=100, speech_pad_ms=30, min_speech_duration_ms=300),
    VadOptions(threshold=0.6, neg_threshold=0.2, speech_pad_ms=900, min_silence_duration_ms=300),
    # A last span that vanishes (< min_speech) moves the padding of the one before it: here
    # settling all spans but the last one fails.
    VadOptions(
        min_speech_duration_ms=250,
        speech_pad_ms=400,
        min_silence_duration_ms=100,
        max_speech_duration_s=3,
    ),
]


def random_probabilities(rng: np.random.Generator, num_frames: int) -> np.ndarray:
    """Runs of speech, in-between and silence frames of random lengths (1-150 frames)."""
    out: list[np.ndarray] = []
    total = 0
    while total < num_frames:
        n = int(rng.integers(1, 150))
        low, high = [(0.5, 1.0), (0.2, 0.5), (0.0, 0.35), (0.0, 1.0)][int(rng.integers(4))]
        out.append(rng.uniform(low, high, n))
        total += n
    return np.concatenate(out)[:num_frames].astype(np.float32)


@pytest.mark.parametrize("opts", OPTIONS)
def test_settled_spans_of_a_prefix_never_change(opts: VadOptions) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        probs = random_probabilities(rng, 2500)
        num_samples = probs.size * FRAME_SAMPLES - int(rng.integers(0, FRAME_SAMPLES))
        full = spans_from_probabilities(probs, num_samples, opts)
        assert settled_spans(probs, num_samples, opts) == full
        for cut in rng.integers(1, probs.size, 25):
            settled = settled_spans(probs[:cut], None, opts)
            assert full[: len(settled)] == settled, (cut, settled[-2:], full[: len(settled)][-2:])


@pytest.fixture(scope="module")
def long_speech(audio_dir: Path) -> np.ndarray:
    """~3 min of the three real clips with 1-3 s silences between them."""
    clips = [np.asarray(load_audio(str(audio_dir / n)), dtype=np.float32) for n in CLIPS]
    rng = np.random.default_rng(0)
    pieces, total, k = [], 0, 0
    while total < 3 * 60 * SR:
        pieces += [clips[k % 3], np.zeros(int(rng.uniform(1.0, 3.0) * SR), np.float32)]
        total += pieces[-2].size + pieces[-1].size
        k += 1
    return np.concatenate(pieces)


@pytest.mark.parametrize("opts", [OPTIONS[1], OPTIONS[3]])
def test_span_stream_hands_out_the_spans_of_all_probabilities(long_speech, opts) -> None:
    layout = dict(workers=3, piece_frames=500, warmup_frames=300, waves=2)
    stream = SpanStream(long_speech, opts, **layout)
    assert stream.num_pieces == 6
    handed: list[list[tuple[int, int]]] = []
    read = 0
    while not stream.done:
        handed.append(stream.take(wait=True))
        # At least the next piece; more when the pool finished them meanwhile (a race).
        assert stream.num_pieces_read > read
        read = stream.num_pieces_read
    probs = speech_probabilities(long_speech, **layout)
    expected = spans_from_probabilities(probs, long_speech.size, opts)
    assert [s for spans in handed for s in spans] == expected and len(expected) > 10
    if len(handed) == stream.num_pieces:  # one piece per take: spans before the last piece
        assert sum(1 for spans in handed[:-1] if spans) >= 3
    assert stream.take() == [] and stream.take(wait=True) == []


def test_each_vad_thread_creates_its_session_once(long_speech, fresh_vad_threads) -> None:
    created = fresh_vad_threads
    first = speech_probabilities(long_speech, piece_frames=500)
    assert created[0] == 2  # four pieces at once on two threads: a session each
    for _ in range(2):
        np.testing.assert_array_equal(speech_probabilities(long_speech, piece_frames=500), first)
    vad.warm_up()
    assert created[0] == 2
