"""Real speech at real lengths: the reference clips of `shared/assets/audio` (LibriSpeech
dev-clean x 2, JFK), each input a fresh variant of one of them, and a word error rate against
the human references.

A variant is its clip shifted by a leading silence (0-490 ms in 10 ms steps) and scaled by a
gain (1.0 down to 0.9 in 0.001 steps), unique per input index and input set: every timed run
gets audio neither side has seen (no encoder or prefix cache can serve it), while the words,
and so the references, stay those of the clip. Requests end on EOS (no forced length).

WER: words after a small normalizer (lower case, punctuation dropped, "mr" -> "mister", ...),
corpus-level edit distance (substitutions + deletions + insertions) / reference words; `jiwer`
is used when installed, else the edit distance below (they agree on these inputs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from _context import asset

SAMPLE_RATE = 16000
CLIPS = (
    ("jfk.flac", "jfk.txt"),
    ("librispeech/test_audio_0.flac", "librispeech/test_audio_0.txt"),
    ("librispeech/test_audio_1.flac", "librispeech/test_audio_1.txt"),
)
"""Audio file and its human reference, under assets/audio."""
SHIFT_STEPS = 50
SHIFT_MS = 10
GAIN_STEP = 0.001


@dataclass(frozen=True)
class Clip:
    name: str
    audio: np.ndarray
    """16 kHz mono float32."""
    reference: str

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def audio_dir() -> str:
    return asset("audio")


def load_clips(directory: str | None = None) -> list[Clip]:
    """The reference clips as 16 kHz mono float32 (librosa's resampling, as the references'
    transformers run did)."""
    import os

    directory = directory or audio_dir()
    clips = []
    for audio_name, text_name in CLIPS:
        audio = _load_16k_mono(os.path.join(directory, audio_name))
        with open(os.path.join(directory, text_name)) as f:
            reference = f.read().strip()
        clips.append(Clip(audio_name, audio.astype(np.float32), reference))
    return clips


def _load_16k_mono(path: str) -> np.ndarray:
    """librosa.load(path, sr=16000, mono=True) where librosa is installed; else soundfile +
    soxr (librosa's default resampler, soxr_hq) for hosts without librosa."""
    try:
        import librosa
    except ImportError:
        import soundfile as sf
        import soxr

        audio, rate = sf.read(path, dtype="float32", always_2d=True)
        audio = audio.mean(axis=1)
        if rate != SAMPLE_RATE:
            audio = soxr.resample(audio, rate, SAMPLE_RATE, quality="HQ")
        return audio
    audio, _ = librosa.load(path, sr=SAMPLE_RATE, mono=True)
    return audio


def variant(clip: Clip, key: int) -> np.ndarray:
    """`clip` shifted by a leading silence and scaled by a gain, both set by `key` (distinct
    keys give distinct audio for up to SHIFT_STEPS * 100 keys)."""
    shift = (key % SHIFT_STEPS) * SHIFT_MS * SAMPLE_RATE // 1000
    gain = np.float32(1.0 - GAIN_STEP * ((key // SHIFT_STEPS) % 100))
    out = np.zeros(shift + len(clip.audio), dtype=np.float32)
    out[shift:] = clip.audio * gain
    return out


@dataclass(frozen=True)
class InputSet:
    audio: list[np.ndarray]
    references: list[str]
    clip_names: list[str]

    @property
    def seconds(self) -> float:
        return sum(len(a) for a in self.audio) / SAMPLE_RATE


def make_inputs(clips: list[Clip], num_inputs: int, input_set: int) -> InputSet:
    """`num_inputs` fresh variants cycling over `clips` (input set `input_set`: its keys follow
    the previous sets', so no two inputs of a benchmark share audio)."""
    audio, refs, names = [], [], []
    for i in range(num_inputs):
        clip = clips[i % len(clips)]
        audio.append(variant(clip, input_set * num_inputs + i))
        refs.append(clip.reference)
        names.append(clip.name)
    return InputSet(audio, refs, names)


# ---------------------------------------------------------------- WER
_ABBREVIATIONS = {"mr": "mister", "mrs": "missus", "dr": "doctor", "st": "saint"}


def normalize(text: str) -> list[str]:
    """Words for WER: lower case, apostrophes kept inside words, other punctuation dropped,
    common abbreviations spelled out."""
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    words = [w.strip("'") for w in text.split()]
    return [_ABBREVIATIONS.get(w, w) for w in words if w]


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance (substitutions, deletions, insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus word error rate of `hypotheses` against `references` (normalized)."""
    refs = [" ".join(normalize(r)) for r in references]
    hyps = [" ".join(normalize(h)) for h in hypotheses]
    try:
        import jiwer

        return float(jiwer.wer(refs, hyps))
    except ImportError:
        pass
    errors = sum(edit_distance(r.split(), h.split()) for r, h in zip(refs, hyps, strict=True))
    words = sum(len(r.split()) for r in refs)
    return errors / max(words, 1)


def num_different(a: list[str], b: list[str]) -> int:
    """Transcripts that differ between two sides (text compared after strip())."""
    return sum(x.strip() != y.strip() for x, y in zip(a, b, strict=True))
