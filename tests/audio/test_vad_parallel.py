"""v1.audio.vad in parallel pieces: a long file's VAD split over threads (each piece warmed up on
the audio before it) finds the speech spans of the single pass on real speech."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from v1.audio import load_audio
from v1.audio.vad import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    VadOptions,
    get_speech_timestamps,
    spans_from_probabilities,
    speech_probabilities,
)

SR = SAMPLE_RATE
CLIPS = ["jfk.flac", "librispeech/test_audio_0.flac", "librispeech/test_audio_1.flac"]


@pytest.fixture(scope="module")
def long_speech(audio_dir: Path) -> np.ndarray:
    """~4 min: the three real clips back to back with 1-3 s silences (the long-form benchmark)."""
    clips = [np.asarray(load_audio(str(audio_dir / n)), dtype=np.float32) for n in CLIPS]
    rng = np.random.default_rng(0)
    pieces, total, k = [], 0, 0
    while total < 4 * 60 * SR:
        gap = np.zeros(int(rng.uniform(1.0, 3.0) * SR), dtype=np.float32)
        pieces += [clips[k % 3], gap]
        total += clips[k % 3].size + gap.size
        k += 1
    return np.concatenate(pieces)


@pytest.fixture(scope="module")
def single_pass(long_speech: np.ndarray) -> np.ndarray:
    return speech_probabilities(long_speech, workers=1)


def _spans(probs: np.ndarray, n_samples: int, opts: VadOptions) -> list[tuple[int, int]]:
    return spans_from_probabilities(probs, n_samples, opts)


def test_two_pieces_give_the_single_pass_spans(long_speech, single_pass) -> None:
    parallel = speech_probabilities(long_speech, workers=2)
    assert parallel.shape == single_pass.shape
    assert np.abs(parallel - single_pass).max() < 0.05
    one = get_speech_timestamps(long_speech, VadOptions(), workers=1)
    two = get_speech_timestamps(long_speech, VadOptions(), workers=2)
    assert len(one) > 10
    assert two == one


@pytest.mark.parametrize(
    "opts",
    [
        VadOptions(),
        VadOptions(max_speech_duration_s=30),  # batched transcription's chunking
        VadOptions(min_silence_duration_ms=100, speech_pad_ms=30),  # many short spans
    ],
)
def test_many_stitches_move_spans_by_at_most_one_frame(long_speech, single_pass, opts) -> None:
    # 12 pieces of ~20 s: 11 stitch points, many inside speech.
    parallel = speech_probabilities(long_speech, workers=12, piece_frames=400)
    reference = _spans(single_pass, long_speech.size, opts)
    stitched = _spans(parallel, long_speech.size, opts)
    assert len(stitched) == len(reference)
    shifts = [
        max(abs(a - c), abs(b - d)) for (a, b), (c, d) in zip(reference, stitched, strict=True)
    ]
    assert max(shifts) <= FRAME_SAMPLES
    assert sum(s > 0 for s in shifts) <= max(2, len(reference) // 10)


def test_without_warm_up_the_pieces_diverge(long_speech, single_pass) -> None:
    # The warm-up is what keeps the stitched probabilities faithful: a cold start at every
    # stitch point gets probabilities far from the single pass.
    cold = speech_probabilities(long_speech, workers=12, piece_frames=400, warmup_frames=0)
    warm = speech_probabilities(long_speech, workers=12, piece_frames=400)
    assert np.abs(cold - single_pass).max() > 0.3
    assert np.abs(warm - single_pass).max() < 0.1


def test_short_audio_is_one_pass_and_bad_arguments_raise(long_speech, single_pass) -> None:
    head = long_speech[: 60 * SR]  # shorter than two pieces: never split
    np.testing.assert_array_equal(
        speech_probabilities(head, workers=8), speech_probabilities(head, workers=1)
    )
    with pytest.raises(ValueError):
        speech_probabilities(head, piece_frames=0)
    with pytest.raises(ValueError):
        speech_probabilities(head, warmup_frames=-1)
