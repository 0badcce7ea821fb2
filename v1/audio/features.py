"""Whisper log-mel features in torch, batched, on the model runner's device.

`LogMelSpectrogram` reproduces `transformers.WhisperFeatureExtractor` (pad or cut to 30 s, Hann
STFT, power, the extractor's own mel filter matrix, log10, max - 8 floor, (x + 4) / 4) in one
batched pass: [B] waveforms at 16 kHz -> [B, n_mels, 3000] float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

Waveforms = torch.Tensor | Sequence[torch.Tensor | np.ndarray]


class LogMelSpectrogram(torch.nn.Module):
    """Batched Whisper log-mel spectrogram; `.to(device)` moves its window and filters."""

    def __init__(
        self,
        mel_filters: np.ndarray | torch.Tensor,
        *,
        n_fft: int = 400,
        hop_length: int = 160,
        n_samples: int = 480_000,
        dither: float = 0.0,
    ) -> None:
        """`mel_filters`: [n_fft // 2 + 1, n_mels], as `WhisperFeatureExtractor.mel_filters`."""
        super().__init__()
        filters = torch.as_tensor(np.asarray(mel_filters), dtype=torch.float32)
        if filters.ndim != 2 or filters.shape[0] != n_fft // 2 + 1:
            raise ValueError(
                f"mel_filters must have shape [{n_fft // 2 + 1}, n_mels], got {tuple(filters.shape)}"
            )
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.n_samples = n_samples
        self.dither = dither
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        # [n_mels, n_freqs]
        self.register_buffer("mel_filters", filters.T.contiguous(), persistent=False)

    @classmethod
    def from_feature_extractor(cls, extractor: WhisperFeatureExtractor) -> LogMelSpectrogram:
        return cls(
            extractor.mel_filters,
            n_fft=extractor.n_fft,
            hop_length=extractor.hop_length,
            n_samples=extractor.n_samples,
            dither=extractor.dither,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> LogMelSpectrogram:
        """Built from the `preprocessor_config.json` of a Whisper model folder (or hub id)."""
        return cls.from_feature_extractor(WhisperFeatureExtractor.from_pretrained(str(model_dir)))

    @property
    def n_mels(self) -> int:
        return self.mel_filters.shape[0]

    @property
    def num_frames(self) -> int:
        """Output frames per item (3000 for 30 s at hop 160)."""
        return self.n_samples // self.hop_length

    def pad_batch(
        self,
        waveforms: Waveforms,
        lengths: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, n_samples] float32 on this module's device: each item cut or zero-padded to 30 s.

        `waveforms` is a list of 1-D arrays/tensors, or a padded [B, N] tensor whose samples
        at and past `lengths[i]` are ignored (zeroed). `out` (a list only): a [B, n_samples]
        float32 tensor where the items live, filled instead of a new one (a CUDA graph's
        static input).
        """
        device = self.window.device
        if isinstance(waveforms, torch.Tensor):
            if out is not None:
                raise ValueError("out applies to a list of waveforms, not a padded tensor")
            if waveforms.ndim != 2:
                raise ValueError(f"expected a [B, N] tensor of waveforms, got {waveforms.shape}")
            batch = waveforms[:, : self.n_samples].to(device, torch.float32)
            if lengths is not None:
                lengths = lengths.to(device)
                positions = torch.arange(batch.shape[1], device=device)
                batch = batch.masked_fill(positions[None, :] >= lengths[:, None], 0.0)
            return torch.nn.functional.pad(batch, (0, self.n_samples - batch.shape[1]))
        if lengths is not None:
            raise ValueError("lengths only apply to a padded [B, N] tensor")
        items = [torch.as_tensor(w)[: self.n_samples] for w in waveforms]
        if not items:
            raise ValueError("empty batch of waveforms")
        if any(w.ndim != 1 for w in items):
            raise ValueError("each waveform must be 1-D (mono)")
        # Assemble where the inputs live (host for numpy), then move the batch at once.
        source_device = items[0].device
        if out is None:
            batch = torch.zeros(
                len(items), self.n_samples, dtype=torch.float32, device=source_device
            )
        else:
            batch = out.zero_()
        for row, w in zip(batch, items, strict=True):  # one copy per item, no per-frame work
            row[: w.shape[0]] = w
        return batch.to(device, non_blocking=True)

    def forward(self, waveforms: Waveforms, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n_mels, num_frames] float32 log-mel features, on this module's device."""
        batch = self.pad_batch(waveforms, lengths)  # [B, n_samples]
        if self.dither != 0.0:
            batch = batch + self.dither * torch.randn_like(batch)
        stft = torch.stft(
            batch, self.n_fft, self.hop_length, window=self.window, return_complex=True
        )  # [B, n_freqs, num_frames + 1]
        power = stft[..., :-1].abs().square()  # [B, n_freqs, num_frames]
        mel = self.mel_filters @ power  # [B, n_mels, num_frames]
        log_mel = mel.clamp(min=1e-10).log10()
        floor = log_mel.amax(dim=(1, 2), keepdim=True) - 8.0  # per item
        return (torch.maximum(log_mel, floor) + 4.0) / 4.0
