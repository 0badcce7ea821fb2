"""AudioClip: the content hash is BLAKE3 of the samples' bytes, read in place, computed once;
only 1-D C-contiguous float32 arrays are clips; a window's clip is one object."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from blake3 import blake3

from tests.utils import count_clip_hashes
from v1.audio import AudioClip, AudioError, split_windows

SR = 16_000


@pytest.fixture
def sha_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    return count_clip_hashes(monkeypatch)


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(round(seconds * SR))).astype(np.float32)


def test_hash_is_blake3_of_the_buffer_computed_once_without_a_copy(sha_calls) -> None:
    samples = noise(2.0)
    clip = AudioClip(samples)
    assert clip.samples is samples and clip.duration_seconds == 2.0
    reference = blake3(samples.tobytes()).hexdigest()
    assert [clip.content_hash for _ in range(3)] == [reference] * 3
    (arg,) = sha_calls  # once, however often it is read
    # blake3 was handed a view of the array itself, not a bytes copy of it.
    assert isinstance(arg, memoryview) and arg.obj is samples
    # A different clip of equal samples hashes equal; one changed sample changes the hash.
    assert AudioClip(samples.copy()).content_hash == reference
    changed = samples.copy()
    changed[-1] += 1.0
    assert AudioClip(changed).content_hash != reference


@pytest.mark.parametrize(
    ("samples", "what"),
    [
        (np.zeros(800, np.float64), "float64"),
        (np.zeros((800, 1), np.float32), "shape \\(800, 1\\)"),
        (np.zeros(1600, np.float32)[::2], "float32 array of shape \\(800,\\)"),
        ([0.0] * 800, "list"),
    ],
)
def test_only_1d_contiguous_float32_arrays_are_clips(samples: Any, what: str) -> None:
    with pytest.raises(AudioError, match=f"1-D C-contiguous float32.*{what}.*load_audio"):
        AudioClip(samples)


def test_a_window_has_one_clip_over_its_own_samples(sha_calls) -> None:
    audio = noise(45.0, seed=1)
    first, second = split_windows(audio, SR)
    assert first.clip is first.clip  # cached: every request of the window gets this object
    assert np.shares_memory(second.clip.samples, audio)
    assert second.clip.samples.shape == (15 * SR,)
    hashes = [w.clip.content_hash for w in (first, second, first, second)]
    assert hashes[:2] == hashes[2:] and len(sha_calls) == 2
    assert hashes[1] == blake3(audio[30 * SR :].tobytes()).hexdigest()
    (other_rate,) = split_windows(np.zeros(8000, np.float32), 8000)
    with pytest.raises(ValueError, match="16 kHz"):
        _ = other_rate.clip
