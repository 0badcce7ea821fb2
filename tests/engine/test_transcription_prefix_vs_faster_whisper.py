"""`prefix` as faster-whisper applies it, against faster-whisper itself (CTranslate2, CPU, the
real whisper-base converted into a temporary folder): the window at 0 s is `<|0.00|> prefix`
decoded WITH timestamps (the first token after the prefix is free), later windows get no prefix
and do get the hotwords. Both sides decode the same encoder input (ours: faster-whisper's
log-mel pads a short window in log-mel space, the engine pads the audio as transformers does),
so what is compared is the decoding: prompts, timestamp rules, seek and segments, token for
token.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.utils import ASSETS, WHISPER_BASE, needs_assets
from v1 import LLM
from v1.audio import SAMPLE_RATE, load_audio
from v1.audio.features import LogMelSpectrogram

AUDIO = ASSETS / "audio"
pytestmark = needs_assets(WHISPER_BASE, AUDIO)
EOS = 50257  # whisper-base's <|endoftext|>: the text tokens are below it


@pytest.fixture(scope="module")
def faster_whisper_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("faster_whisper")
    ctranslate2 = pytest.importorskip("ctranslate2")
    from ctranslate2.converters import TransformersConverter
    from faster_whisper import WhisperModel

    target = Path(tmp_path_factory.mktemp("ct2")) / "whisper-base"
    TransformersConverter(
        str(WHISPER_BASE), copy_files=["tokenizer.json", "preprocessor_config.json"]
    ).convert(str(target), quantization="float32")
    model = WhisperModel(str(target), device="cpu", compute_type="float32", cpu_threads=1)
    return model, ctranslate2


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with LLM(str(WHISPER_BASE), device="cpu", multiprocess=False) as engine:
        yield engine
    torch.set_num_threads(threads)


Segments = list[tuple[float, float, str, list[int]]]


def faster_whisper_segments(model_and_ct2: Any, audio: np.ndarray, **options: Any) -> Segments:
    """faster-whisper's `transcribe` (greedy, no fallback), each window encoded from the
    engine's features of that window's samples. Ends past the audio are clamped to it, as the
    engine's segments are."""
    model, ctranslate2 = model_and_ct2
    mel = LogMelSpectrogram.from_pretrained(WHISPER_BASE)

    def encode(_features: Any) -> Any:
        caller = sys._getframe(1).f_locals  # generate_segments: the window it encodes
        assert "seek" in caller and "segment_size" in caller, "faster-whisper changed"
        seek, size = caller["seek"], caller["segment_size"]
        window = torch.from_numpy(audio[seek * 160 : (seek + size) * 160])
        features = np.ascontiguousarray(mel([window]).numpy())
        return model.model.encode(ctranslate2.StorageView.from_array(features))

    model.encode = encode
    try:
        segments, _ = model.transcribe(
            audio, language="en", beam_size=1, temperature=0.0, **options
        )
        duration = audio.size / SAMPLE_RATE
        return [
            (
                round(s.start, 2),
                round(min(s.end, duration), 2),
                s.text,
                [t for t in s.tokens if t < EOS],
            )
            for s in segments
        ]
    finally:
        del model.encode  # the class's own again


def engine_segments(llm: LLM, audio: np.ndarray, **options: Any) -> Segments:
    (result,) = llm.transcribe(
        (audio, SAMPLE_RATE),
        language="en",
        timestamps=True,
        temperature=0.0,
        use_tqdm=False,
        **options,
    )
    return [(round(s.start, 2), round(s.end, 2), s.text, s.tokens) for s in result.segments]


def test_prefixed_window_is_timed_as_faster_whisper(llm, faster_whisper_model) -> None:
    """jfk with a prefix that is not what is said: faster-whisper times it in five segments;
    decoded without timestamps the window would be one 0-11 s segment."""
    audio = load_audio(AUDIO / "jfk.flac")
    ours = engine_segments(llm, audio, prefix="A woman said")
    theirs = faster_whisper_segments(faster_whisper_model, audio, prefix="A woman said")
    assert ours == theirs
    assert len(ours) >= 3 and ours[0][2].startswith(" A woman said")
    assert ours[0][:2] == (0.0, 2.0)


@pytest.mark.slow  # ~15 s of CPU
def test_prefix_then_hotwords_over_two_windows_as_faster_whisper(llm, faster_whisper_model):
    """Over 30 s: the prefix starts the first window only; the second window's prompt has the
    hotwords and the previous text (the prefix among it); seek and times as faster-whisper."""
    names = ["jfk.flac", "librispeech/test_audio_0.flac", "jfk.flac"]
    names += ["librispeech/test_audio_1.flac"]
    audio = np.concatenate([load_audio(AUDIO / n) for n in names])
    assert audio.size / SAMPLE_RATE > 30.0
    options = {"prefix": "A woman said", "hotwords": "Quilter"}
    ours = engine_segments(llm, audio, **options)
    theirs = faster_whisper_segments(faster_whisper_model, audio, **options)
    assert ours == theirs
    assert ours[0][2].startswith(" A woman said")
    assert sum(s[2].count("A woman said") for s in ours) == 1  # forced once
    assert ours[-1][1] > 30.0  # a second window was decoded
