"""`AudioClip`: the audio of one Whisper encoder input and its content hash, computed once.

Requests built from one clip (n > 1 completions, a window's language detection and its
transcription, retries) share the clip's hash, hence one encoder run, without hashing again.
"""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from v1.audio.decode import SAMPLE_RATE, AudioError

HASH_THREADS = 1
"""Threads per hash. One: the frontend hashes beside busy engine cores, where blake3's thread
pool waited on them (2 H200s, DP 2: 2.1 ms per 30 s clip on all threads, on the frontend's
critical path; one thread ~0.45 ms)."""


class AudioClip:
    """float32 mono 16 kHz samples, used in place (never copied), and their content hash.

    `content_hash` is the BLAKE3 hex digest of the samples' bytes (as vLLM hashes multimodal
    inputs: ~6x faster than sha256 on a 30 s clip, which the host pays for every clip), read
    straight from the array's buffer (no copy), computed on first use and kept. The clip does not own its samples:
    leave the array unchanged while the clip, or a request made from it, is in use.
    Pass a clip as `multi_modal_data={"audio": clip}` to reuse its hash across requests.
    """

    __slots__ = ("_content_hash", "samples")

    def __init__(self, samples: np.ndarray) -> None:
        """`samples`: a 1-D C-contiguous float32 array at 16 kHz (what `load_audio` returns);
        anything else raises AudioError (convert it with `load_audio((samples, rate))`)."""
        if not (
            isinstance(samples, np.ndarray)
            and samples.ndim == 1
            and samples.dtype == np.float32
            and samples.flags.c_contiguous
        ):
            got = (
                f"{samples.dtype} array of shape {samples.shape}"
                if isinstance(samples, np.ndarray)
                else type(samples).__name__
            )
            raise AudioError(
                "an AudioClip holds a 1-D C-contiguous float32 array of 16 kHz samples, got a "
                f"{got}; load_audio((samples, sample_rate)) converts other audio"
            )
        self.samples = samples
        self._content_hash: str | None = None

    @property
    def content_hash(self) -> str:
        if self._content_hash is None:
            # blake3 reads the buffer in place (the same bytes as samples.tobytes()); the
            # digest does not depend on the thread count.
            data = memoryview(self.samples).cast("B")
            self._content_hash = blake3(data, max_threads=HASH_THREADS).hexdigest()
        return self._content_hash

    @property
    def duration_seconds(self) -> float:
        return self.samples.shape[0] / SAMPLE_RATE

    def __repr__(self) -> str:
        return f"AudioClip({self.duration_seconds:.2f} s)"
