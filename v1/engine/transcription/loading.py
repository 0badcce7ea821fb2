"""Audio inputs of a transcription -> 16 kHz float32 waveforms, decoded once, at the edge.

Every input is checked before any request is made; past a few inputs they load on threads
(decoding and the finiteness check release the GIL). Errors name the first bad input, in order.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from v1.audio import AudioError, load_audio

_PARALLEL_LOAD_MIN = 8
"""Inputs below which `load_audio_inputs` loads on the calling thread."""
_LOAD_THREADS = min(8, os.cpu_count() or 1)


def load_audio_inputs(audio: Any) -> list[np.ndarray]:
    """One source or a list of them (path, bytes, `(samples, sample_rate)`) -> float32 16 kHz
    waveforms; every input is checked before any request is made. The one `load_audio` of a
    transcription: its windows use these samples as they are."""
    sources = audio if isinstance(audio, list) else [audio]
    if not sources:
        raise AudioError("no audio given (an empty list)")

    def load(i: int) -> np.ndarray:
        try:
            return load_audio(sources[i])
        except AudioError as e:
            where = f"audio input {i}: " if len(sources) > 1 else ""
            raise AudioError(f"{where}{e}") from e

    if len(sources) < _PARALLEL_LOAD_MIN:
        return [load(i) for i in range(len(sources))]
    # map() raises the first failing input's error, in input order.
    with ThreadPoolExecutor(min(_LOAD_THREADS, len(sources))) as pool:
        return list(pool.map(load, range(len(sources))))
