"""LogMelSpectrogram against transformers' WhisperFeatureExtractor, batched, 80 and 128 bins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from v1.audio import LogMelSpectrogram, load_audio

SR = 16_000


def random_batch(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in lengths]


# Short, 5 s, exactly 30 s, and 35 s (truncated); one quiet item so its max-8 floor differs.
MIXED_LENGTHS = [1_000, 5 * SR, 30 * SR, 35 * SR]


def reference(extractor: WhisperFeatureExtractor, batch: list[np.ndarray]) -> np.ndarray:
    return extractor(batch, sampling_rate=SR, return_tensors="np").input_features


@pytest.mark.parametrize("n_mels", [80, 128])
def test_matches_whisper_feature_extractor(n_mels: int) -> None:
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    log_mel = LogMelSpectrogram.from_feature_extractor(extractor)
    batch = random_batch(MIXED_LENGTHS)
    batch[1] *= 1e-3
    features = log_mel(batch)
    assert features.shape == (len(batch), n_mels, 3000)
    assert features.dtype == torch.float32
    expected = reference(extractor, batch)
    assert np.abs(features.numpy() - expected).max() < 1e-4
    # Items are independent: each matches its own single-item extraction.
    single = log_mel([batch[2]])
    torch.testing.assert_close(single[0], features[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_matches_on_real_speech(audio_dir: Path, n_mels: int) -> None:
    names = ["jfk.flac", "librispeech/test_audio_0.flac", "hotwords.mp3"]
    batch = [load_audio(audio_dir / name) for name in names]
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    features = LogMelSpectrogram.from_feature_extractor(extractor)(batch)
    assert np.abs(features.numpy() - reference(extractor, batch)).max() < 1e-4


def test_padded_tensor_with_lengths_ignores_the_padding() -> None:
    extractor = WhisperFeatureExtractor(feature_size=80)
    log_mel = LogMelSpectrogram.from_feature_extractor(extractor)
    batch = random_batch([SR, 3 * SR, 31 * SR], seed=1)
    lengths = torch.tensor([len(w) for w in batch])
    padded = torch.full((len(batch), int(lengths.max())), 0.7)  # garbage past each length
    for row, w in zip(padded, batch, strict=True):
        row[: len(w)] = torch.from_numpy(w)
    from_tensor = log_mel(padded, lengths)
    torch.testing.assert_close(from_tensor, log_mel(batch), atol=0, rtol=0)
    assert np.abs(from_tensor.numpy() - reference(extractor, batch)).max() < 1e-4
    # Without lengths the padding counts as signal.
    assert not torch.equal(log_mel(padded), from_tensor)


def test_pad_batch_fills_a_given_buffer() -> None:
    """`out`: a static buffer (a CUDA graph's input) is filled as a new batch would be, stale
    samples past each item cleared; a padded tensor takes no buffer."""
    log_mel = LogMelSpectrogram.from_feature_extractor(WhisperFeatureExtractor(feature_size=80))
    batch = [torch.from_numpy(w) for w in random_batch([SR, 35 * SR], seed=3)]
    buffer = torch.full((2, log_mel.n_samples), 0.7)
    filled = log_mel.pad_batch(batch, out=buffer)
    assert filled.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer, log_mel.pad_batch(batch), atol=0, rtol=0)
    with pytest.raises(ValueError, match="out applies to a list"):
        log_mel.pad_batch(torch.zeros(2, SR), out=buffer)


def test_from_pretrained_model_folder(whisper_base_dir: Path) -> None:
    log_mel = LogMelSpectrogram.from_pretrained(whisper_base_dir)
    assert (log_mel.n_mels, log_mel.num_frames) == (80, 3000)
    extractor = WhisperFeatureExtractor.from_pretrained(str(whisper_base_dir))
    batch = random_batch([2 * SR], seed=2)
    assert np.abs(log_mel(batch).numpy() - reference(extractor, batch)).max() < 1e-4


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="mel_filters must have shape"):
        LogMelSpectrogram(np.zeros((80, 201)))
    log_mel = LogMelSpectrogram.from_feature_extractor(WhisperFeatureExtractor(feature_size=80))
    with pytest.raises(ValueError, match="1-D"):
        log_mel([np.zeros((2, SR), np.float32)])
    with pytest.raises(ValueError, match="empty batch"):
        log_mel([])
    with pytest.raises(ValueError, match="lengths only apply"):
        log_mel([np.zeros(SR, np.float32)], torch.tensor([SR]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu() -> None:
    extractor = WhisperFeatureExtractor(feature_size=128)
    batch = random_batch(MIXED_LENGTHS, seed=3)
    cpu = LogMelSpectrogram.from_feature_extractor(extractor)(batch)
    cuda = LogMelSpectrogram.from_feature_extractor(extractor).to("cuda")(batch)
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, atol=1e-4, rtol=0)
