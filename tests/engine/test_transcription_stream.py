"""Segments as they are decoded: `LLM.transcribe(..., stream=True)` is a lazy iterator of final
segments (faster-whisper's `segments` generator), and `v1 transcribe --timestamps` prints each
'[start --> end] text' line as soon as its window is decoded, while the process still runs.
Real whisper-base on real speech concatenated past one 30 s window (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, needs_assets
from v1 import LLM
from v1.audio import load_audio

AUDIO = ASSETS / "audio"
SR = 16_000
pytestmark = [needs_assets(WHISPER_BASE, AUDIO), ONE_TORCH_THREAD]


@pytest.fixture(scope="module")
def long_speech() -> np.ndarray:
    """~35 s: two windows of real speech (JFK, two LibriSpeech clips, JFK again)."""
    jfk = load_audio(AUDIO / "jfk.flac")
    a0 = load_audio(AUDIO / "librispeech" / "test_audio_0.flac")
    a1 = load_audio(AUDIO / "librispeech" / "test_audio_1.flac")
    gap = np.zeros(SR, dtype=np.float32)
    return np.concatenate([jfk, gap, a0, gap, a1, gap, jfk])


def test_stream_yields_final_segments_lazily(long_speech: np.ndarray) -> None:
    with LLM(str(WHISPER_BASE), device="cpu", multiprocess=False) as llm:
        stream = llm.transcribe((long_speech, SR), language="en", stream=True, use_tqdm=False)
        # Nothing runs until the stream is read.
        assert not llm.llm_engine.has_unfinished_requests()
        first = next(stream)
        # The first segment comes while the file's last window is still to be decoded.
        assert first.start < 1.0 and "fellow Americans" in first.text
        assert first.end < 30.0 and stream.input_index == 0
        rest = list(stream)
        result = stream.result
        # The streamed segments are the result's, final: same objects, in order.
        assert [first, *rest] == result.segments and all(
            a is b for a, b in zip([first, *rest], result.segments, strict=True)
        )
        assert [s.id for s in result.segments] == list(range(len(result.segments)))
        assert result.segments[-1].end > 30.0 and "your country" in result.segments[-1].text
        assert "universe" in result.text and "matter" in result.text
        assert not llm.llm_engine.has_unfinished_requests()

        # Closing a stream early aborts its requests: the engine is free for the next call.
        stream = llm.transcribe((long_speech, SR), language="en", stream=True, use_tqdm=False)
        next(stream)
        stream.close()
        assert not llm.llm_engine.has_unfinished_requests()
        assert list(stream) == []


@pytest.mark.slow  # a process that loads the model: ~20 s on an idle 2-core box
def test_cli_prints_each_segment_while_the_file_is_still_decoding(
    long_speech: np.ndarray, tmp_path: Path
) -> None:
    import soundfile

    path = tmp_path / "speech.wav"
    soundfile.write(path, long_speech, SR)
    command = [
        sys.executable,
        "-m",
        "v1",
        "transcribe",
        str(path),
        "--model",
        str(WHISPER_BASE),
        "--device",
        "cpu",
        "--language",
        "en",
        "--timestamps",
        "--quiet",
    ]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        # The first window's first line is out while the second window is still decoding.
        running_after_first_line = proc.poll() is None
        rest = proc.stdout.read()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert first.startswith("[00:00.000 --> 00:") and "fellow Americans" in first
    assert running_after_first_line
    lines = [first.rstrip("\n"), *rest.splitlines()]
    assert all(line.startswith("[") and " --> " in line for line in lines)
    assert len(lines) >= 3 and " --> 00:3" in lines[-1] and "country" in lines[-1]
