"""Voice activity detection: the Silero VAD model that the `silero-vad` package ships.

One component for the whole engine: offline (`get_speech_timestamps` for `vad_filter=True`,
`SpanStream` for batched long-form transcription, which decodes while VAD still runs) and
streaming (`VadIterator`, fed chunks of any size by a realtime session, reports where speech
starts and ends). Both run the package's "sequence" ONNX export through onnxruntime (one call
per block of 32 ms frames, no per-frame Python loop), one session per thread, created once;
the streaming path carries the LSTM state and the 64-sample context between calls, so it sees
exactly the probabilities the offline single pass sees. Offline, a file longer than ~4 min runs
as pieces on the process's bounded pool of VAD threads (`vad_pool`), each piece warmed up on
the ~30 s before it (`speech_probabilities`). The probabilities become speech spans through
the package's own state machine (`get_speech_timestamps_from_probs`).

Options and defaults are faster-whisper's (`VadOptions`): a 2 s silence ends a span, spans are
padded by 400 ms. Audio is float32 mono 16 kHz (what `load_audio` returns); positions are
sample indices at 16 kHz.

API (stable; the realtime session imports it): `VadOptions`, `get_speech_timestamps`,
`speech_probabilities`, `SpanStream`, `VadIterator`, `VadEvent`, `SpeechMap`, `collect_speech`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

SAMPLE_RATE = 16000
FRAME_SAMPLES = 512  # one Silero frame: 32 ms at 16 kHz
CONTEXT_SAMPLES = 64  # each frame sees the previous frame's last 64 samples
_BLOCK_FRAMES = 512  # frames per ONNX call (~16 s)
_PIECE_FRAMES = 3750  # offline VAD in parallel: pieces of at least ~2 min ...
_WARMUP_FRAMES = 940  # ... each warmed up on the ~30 s of audio before it
_STATE_SHAPE = (1, 1, 128)


@dataclasses.dataclass(frozen=True)
class VadOptions:
    """Silero VAD options (faster-whisper's names and defaults)."""

    threshold: float = 0.5
    """A frame whose speech probability is at or above this is speech."""
    neg_threshold: float | None = None
    """Inside speech, a frame below this is silence (None: `max(threshold - 0.15, 0.01)`)."""
    min_speech_duration_ms: int = 0
    """Speech spans shorter than this are dropped."""
    max_speech_duration_s: float = float("inf")
    """Longer spans are split at the last silence over 98 ms, else cut just before this length."""
    min_silence_duration_ms: int = 2000
    """A span ends only after this much silence."""
    speech_pad_ms: int = 400
    """Each span is widened by this much on both sides (clipped to the audio)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"VAD threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 < self.neg_threshold <= self.threshold:
            raise ValueError(
                f"VAD neg_threshold must be in (0, threshold={self.threshold}], "
                f"got {self.neg_threshold}"
            )
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"VAD {name} must be a number >= 0, got {value!r}")
        if not self.max_speech_duration_s > 0:
            raise ValueError(
                f"VAD max_speech_duration_s must be > 0, got {self.max_speech_duration_s}"
            )

    @property
    def effective_neg_threshold(self) -> float:
        """The silence threshold used inside speech."""
        if self.neg_threshold is not None:
            return self.neg_threshold
        return max(self.threshold - 0.15, 0.01)

    @classmethod
    def from_value(cls, value: VadOptions | Mapping[str, Any] | None) -> VadOptions:
        """`VadOptions` from a `VadOptions`, a dict of its fields, or None (the defaults).

        An unknown key is a ValueError naming the known ones.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown vad_parameters {unknown}; known: {sorted(known)}")
            return cls(**dict(value))
        raise ValueError(f"vad_parameters must be a dict or VadOptions, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# The model


def _silero_data_dir() -> str:
    """The folder of the models the silero-vad package ships, found without importing it.

    Importing `silero_vad` imports torch and calls `torch.set_num_threads(1)` for the whole
    process; the engine must not lose its threads because a VAD was asked for.
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed (pip install silero-vad)")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


_thread_state = threading.local()


def _session() -> Any:
    """This thread's onnxruntime session of silero_vad_16k_sequence.onnx, created on the
    thread's first VAD call and kept for the thread's life: the VAD threads (`vad_pool`) live
    as long as the process, so later files and calls create none (and threads never race to
    create one)."""
    session = getattr(_thread_state, "session", None)
    if session is None:
        session = _thread_state.session = _new_session()
    return session


def _new_session() -> Any:
    import os

    import onnxruntime

    path = os.path.join(_silero_data_dir(), "silero_vad_16k_sequence.onnx")
    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return onnxruntime.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=1)
def _from_probs() -> Any:
    """silero-vad's probabilities -> spans state machine (imported keeping torch's threads)."""
    import torch

    threads = torch.get_num_threads()
    try:
        from silero_vad.utils_vad import get_speech_timestamps_from_probs
    finally:
        torch.set_num_threads(threads)
    return get_speech_timestamps_from_probs


class _FrameModel:
    """The recurrent state of one stream: LSTM (h, c) and the previous frame's tail."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.h = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self.c = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self.context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)

    def forward(self, frames: np.ndarray) -> np.ndarray:
        """Probabilities of whole frames (n_frames, 512), continuing the stream's state."""
        session = _session()
        out: list[np.ndarray] = []
        for first in range(0, frames.shape[0], _BLOCK_FRAMES):
            block = frames[first : first + _BLOCK_FRAMES]
            ctx = np.empty((block.shape[0], CONTEXT_SAMPLES), dtype=np.float32)
            ctx[0] = self.context
            if block.shape[0] > 1:
                ctx[1:] = block[:-1, -CONTEXT_SAMPLES:]
            self.context = block[-1, -CONTEXT_SAMPLES:].copy()
            probs, self.h, self.c = session.run(
                ["speech_probs", "hn", "cn"],
                {"input": np.concatenate((ctx, block), axis=1), "h": self.h, "c": self.c},
            )
            out.append(np.asarray(probs, dtype=np.float32).reshape(-1))
        if not out:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(out)


def _as_audio(audio: Any) -> np.ndarray:
    if hasattr(audio, "detach"):
        audio = audio.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(audio, dtype=np.float32))
    if arr.ndim != 1:
        raise ValueError(f"VAD audio must be 1-D mono 16 kHz samples, got shape {arr.shape}")
    return arr


def default_vad_workers() -> int:
    """Threads the offline VAD splits a long file over: the CPUs this process may use (<= 16)."""
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0


def vad_pool() -> tuple[ThreadPoolExecutor, int]:
    """The process's VAD threads and their number (`default_vad_workers()` when first asked):
    every offline VAD (the offline `LLM`, all server requests at once) queues its pieces here,
    so the threads stay bounded however many long files arrive together. Each thread keeps its
    own onnxruntime session (`_session`)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None:
            _pool_workers = default_vad_workers()
            _pool = ThreadPoolExecutor(max_workers=_pool_workers, thread_name_prefix="vad")
        return _pool, _pool_workers


def warm_up() -> None:
    """Starts every VAD thread with its session, and silero's span code, now rather than inside
    the first long file (a server or a benchmark pays this once per process)."""
    _from_probs()
    pool, workers = vad_pool()
    barrier = threading.Barrier(workers)

    def start_thread() -> None:
        _session()
        barrier.wait(timeout=60)  # one task per thread: each holds its thread until all started

    for future in [pool.submit(start_thread) for _ in range(workers)]:
        future.result()


def _piece_bounds(n_frames: int, workers: int, piece_frames: int, waves: int) -> list[int]:
    """Frame bounds of the pieces of a file of `n_frames`: up to `waves * workers` equal pieces
    of at least `piece_frames` (one piece when the file is shorter than two)."""
    if piece_frames < 1 or waves < 1:
        raise ValueError("VAD piece_frames and waves must be >= 1")
    n_pieces = max(1, min(waves * max(1, workers), n_frames // piece_frames))
    return [n_frames * k // n_pieces for k in range(n_pieces + 1)]


def _piece_probabilities(audio: np.ndarray, lo: int, hi: int, warmup: int) -> np.ndarray:
    """Probabilities of frames [lo, hi) of `audio` (the last frame zero-padded): the model
    starts from a zero LSTM state `warmup` frames earlier (with the true 64-sample context) and
    those warm-up outputs are dropped. Frames are views of `audio` (a copy only for the padded
    last frame)."""
    first = max(0, lo - warmup)
    samples = audio[first * FRAME_SAMPLES : hi * FRAME_SAMPLES]
    missing = (hi - first) * FRAME_SAMPLES - samples.size
    if missing:
        samples = np.concatenate((samples, np.zeros(missing, dtype=np.float32)))
    model = _FrameModel()
    if first > 0:
        model.context = audio[first * FRAME_SAMPLES - CONTEXT_SAMPLES : first * FRAME_SAMPLES]
    return model.forward(samples.reshape(hi - first, FRAME_SAMPLES))[lo - first :]


def _submit_pieces(
    audio: np.ndarray, workers: int | None, piece_frames: int, warmup_frames: int, waves: int
) -> list[Future[np.ndarray]]:
    """The pieces of `audio`, in file order, queued on the VAD threads."""
    if warmup_frames < 0:
        raise ValueError("VAD warmup_frames must be >= 0")
    pool, pool_workers = vad_pool()
    workers = pool_workers if workers is None else int(workers)
    bounds = _piece_bounds(
        math.ceil(audio.size / FRAME_SAMPLES), workers, piece_frames, 1 if workers == 1 else waves
    )
    return [
        pool.submit(_piece_probabilities, audio, lo, hi, warmup_frames)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        if hi > lo
    ]


def speech_probabilities(
    audio_16k: Any,
    *,
    workers: int | None = None,
    piece_frames: int = _PIECE_FRAMES,
    warmup_frames: int = _WARMUP_FRAMES,
    waves: int = 1,
) -> np.ndarray:
    """Silero's speech probability of each 32 ms frame (the last one zero-padded).

    Audio longer than two pieces (`piece_frames`, ~2 min) runs as up to `waves * workers`
    pieces on the VAD threads (None: the pool's threads; onnxruntime releases the GIL). Each
    piece after the first starts its LSTM from zero `warmup_frames` (~30 s) before its first
    frame, on the real audio there, and drops those outputs. The recurrent state forgets its
    start slowly, so a stitched probability can differ from the single pass by a few
    hundredths; tests/audio/test_vad_parallel.py checks the speech spans stay those of the
    single pass on real speech. `workers=1` is the single pass (faster-whisper's way)."""
    audio = _as_audio(audio_16k)
    futures = _submit_pieces(audio, workers, piece_frames, warmup_frames, waves)
    if not futures:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.result() for f in futures])


def get_speech_timestamps(
    audio_16k: Any,
    options: VadOptions | Mapping[str, Any] | None = None,
    *,
    workers: int | None = None,
) -> list[tuple[int, int]]:
    """Speech spans of 16 kHz mono audio as `(start_sample, end_sample)`, in order, disjoint.

    `workers`: threads for a long file (`speech_probabilities`; None: the CPUs, 1: one pass)."""
    opts = VadOptions.from_value(options)
    audio = _as_audio(audio_16k)
    if audio.size == 0:
        return []
    return spans_from_probabilities(speech_probabilities(audio, workers=workers), audio.size, opts)


class SpanStream:
    """The speech spans of one recording while its VAD still runs: its pieces (as
    `speech_probabilities(..., waves=2)`: more pieces than threads, so the first ones finish
    early) are queued on the VAD threads at once, and `take` hands out, in order, the spans
    that no later piece can change. All of them, once every piece is in, are exactly
    `spans_from_probabilities` of all the probabilities (a test holds it).

    """

    def __init__(
        self,
        audio_16k: Any,
        options: VadOptions | Mapping[str, Any] | None = None,
        *,
        workers: int | None = None,
        piece_frames: int = _PIECE_FRAMES,
        warmup_frames: int = _WARMUP_FRAMES,
        waves: int = 2,
    ) -> None:
        self.options = VadOptions.from_value(options)
        self._audio = _as_audio(audio_16k)
        self._futures = deque(
            _submit_pieces(self._audio, workers, piece_frames, warmup_frames, waves)
        )
        self.num_pieces = len(self._futures)
        """Pieces the recording was cut into."""
        self.num_pieces_read = 0
        """Pieces whose probabilities `take` has read (in file order)."""
        self._probs: list[np.ndarray] = []
        self._settled: list[tuple[int, int]] = []

    @property
    def done(self) -> bool:
        """Every piece is read and every span handed out."""
        return not self._futures

    def take(self, wait: bool = False) -> list[tuple[int, int]]:
        """The spans settled since the last call, in order. Reads the pieces finished so far
        in file order; `wait`: first waits for the next piece (when one is left)."""
        read = 0
        while self._futures and (self._futures[0].done() or (wait and not read)):
            self._probs.append(self._futures.popleft().result())
            read += 1
        if not read:
            return []
        self.num_pieces_read += read
        probs = np.concatenate(self._probs) if len(self._probs) > 1 else self._probs[0]
        self._probs = [probs]
        num_samples = None if self._futures else self._audio.size
        spans = settled_spans(probs, num_samples, self.options)
        assert spans[: len(self._settled)] == self._settled, "a settled VAD span changed"
        new = spans[len(self._settled) :]
        self._settled = spans
        return new

    def wait(self) -> None:
        """Waits until every piece has finished (the next `take` then reads them all)."""
        concurrent.futures.wait(self._futures)

    def close(self) -> None:
        """Drops the pieces not started yet (a transcription stopped early)."""
        for future in self._futures:
            future.cancel()
        self._futures.clear()


def settled_spans(
    probs: np.ndarray, num_samples: int | None, options: VadOptions
) -> list[tuple[int, int]]:
    """The spans of the first `len(probs)` frames of a recording that no later frame can
    change (`num_samples`: the recording's length once `probs` are all its frames, then all
    its spans; None while more frames may follow).

    Why they are settled: silero's state machine reads the probabilities frame after frame,
    so over a prefix of the frames it closes the same spans as over all of them; only its last
    span may still grow, be cut at max_speech_duration_s (its start stays) or, shorter than
    `min_speech_duration_ms`, vanish; and a span's padding reads only its neighbours' starts
    and ends. So of the spans of a prefix, all but the last two are final.
    tests/audio/test_vad_stream.py checks it on random probabilities and options."""
    if num_samples is not None:
        return spans_from_probabilities(probs, num_samples, options)
    spans = spans_from_probabilities(probs, probs.size * FRAME_SAMPLES, options)
    return spans[: max(0, len(spans) - 2)]


def spans_from_probabilities(
    probs: np.ndarray, num_samples: int, options: VadOptions
) -> list[tuple[int, int]]:
    """silero-vad's spans (start, end samples; empty ones dropped) of frame probabilities
    `probs` over `num_samples` samples of 16 kHz audio."""
    spans = _from_probs()(
        probs.tolist(),
        sampling_rate=SAMPLE_RATE,
        threshold=options.threshold,
        neg_threshold=options.effective_neg_threshold,
        min_speech_duration_ms=options.min_speech_duration_ms,
        max_speech_duration_s=options.max_speech_duration_s,
        min_silence_duration_ms=options.min_silence_duration_ms,
        speech_pad_ms=options.speech_pad_ms,
        audio_length_samples=int(num_samples),
    )
    return [(int(s["start"]), int(s["end"])) for s in spans if s["end"] > s["start"]]


# --------------------------------------------------------------------------------------------
# Streaming


@dataclasses.dataclass(frozen=True)
class VadEvent:
    """Speech started or ended in a stream, at a sample index counted from the stream's start."""

    kind: str
    """"start" or "end"."""
    sample: int
    """Position at 16 kHz from the first sample fed (pad included, clipped at 0)."""

    @property
    def seconds(self) -> float:
        return self.sample / SAMPLE_RATE


class VadIterator:
    """Streaming VAD: `feed(chunk)` with chunks of any length returns the events they complete.

    Speech starts at the first frame at or above `threshold` (reported `speech_pad_ms` earlier);
    it ends once frames stay below the negative threshold for `min_silence_duration_ms`
    (reported `speech_pad_ms` after the last speech frame). `flush()` ends open speech at the
    stream's end. Frame probabilities equal the offline path's for the same samples. One
    object per stream; the onnxruntime session behind it is shared and thread-safe.
    """

    def __init__(self, options: VadOptions | Mapping[str, Any] | None = None) -> None:
        self.options = VadOptions.from_value(options)
        self._model = _FrameModel()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget the stream: state, buffered samples and position go back to zero."""
        self._model.reset()
        self._pending = np.zeros(0, dtype=np.float32)
        self.samples_seen = 0  # samples turned into frames so far
        self.triggered = False
        self._temp_end = 0
        self._last_prob = 0.0

    @property
    def in_speech(self) -> bool:
        """Whether the stream is inside a speech span now."""
        return self.triggered

    @property
    def last_probability(self) -> float:
        """Speech probability of the most recent frame."""
        return self._last_prob

    def feed(self, chunk: Any) -> list[VadEvent]:
        """Feed 16 kHz float32 samples; return the start/end events they complete, in order."""
        with self._lock:
            audio = _as_audio(chunk)
            buf = np.concatenate((self._pending, audio)) if self._pending.size else audio
            n_frames = buf.size // FRAME_SAMPLES
            self._pending = buf[n_frames * FRAME_SAMPLES :].copy()
            if n_frames == 0:
                return []
            frames = buf[: n_frames * FRAME_SAMPLES].reshape(n_frames, FRAME_SAMPLES)
            return self._step(self._model.forward(frames))

    def flush(self) -> list[VadEvent]:
        """End of stream: an open span ends at the last sample fed (plus nothing)."""
        with self._lock:
            total = self.samples_seen + self._pending.size
            self._pending = np.zeros(0, dtype=np.float32)
            if not self.triggered:
                return []
            self.triggered = False
            self._temp_end = 0
            return [VadEvent("end", int(total))]

    def _step(self, probs: np.ndarray) -> list[VadEvent]:
        opts = self.options
        pad = int(SAMPLE_RATE * opts.speech_pad_ms / 1000)
        min_silence = SAMPLE_RATE * opts.min_silence_duration_ms / 1000
        neg = opts.effective_neg_threshold
        events: list[VadEvent] = []
        for p in probs.tolist():
            frame_start = self.samples_seen
            self.samples_seen += FRAME_SAMPLES
            self._last_prob = p
            if p >= opts.threshold and self._temp_end:
                self._temp_end = 0
            if p >= opts.threshold and not self.triggered:
                self.triggered = True
                events.append(VadEvent("start", max(0, frame_start - pad)))
                continue
            if self.triggered and p < neg:
                if not self._temp_end:
                    self._temp_end = frame_start
                if self.samples_seen - self._temp_end >= min_silence:
                    events.append(VadEvent("end", self._temp_end + pad))
                    self._temp_end = 0
                    self.triggered = False
        return events


# --------------------------------------------------------------------------------------------
# Speech-only audio and the way back to the original timeline


class SpeechMap:
    """Maps times in the concatenation of speech spans back to the original recording."""

    def __init__(self, spans: Sequence[tuple[int, int]], sample_rate: int = SAMPLE_RATE) -> None:
        self.spans = [(int(s), int(e)) for s, e in spans]
        self.sample_rate = sample_rate
        self._chunk_end: list[int] = []  # end of each span in the concatenation (samples)
        self._offset: list[int] = []  # original start - concatenated start, per span
        pos = 0
        for s, e in self.spans:
            self._offset.append(s - pos)
            pos += e - s
            self._chunk_end.append(pos)

    def original_time(self, t: float, is_end: bool = False) -> float:
        """Seconds in the concatenation -> seconds in the recording.

        A time that falls exactly on a span boundary belongs to the earlier span when it is an
        end time, to the later span when it is a start time.
        """
        if not self.spans:
            return t
        sample = int(round(t * self.sample_rate))
        if is_end:
            idx = bisect.bisect_left(self._chunk_end, sample)
        else:
            idx = bisect.bisect_right(self._chunk_end, sample)
        idx = min(idx, len(self.spans) - 1)
        return round((sample + self._offset[idx]) / self.sample_rate, 3)


def collect_speech(audio_16k: Any, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The samples of the spans, concatenated (empty float32 array when there are none)."""
    audio = _as_audio(audio_16k)
    if not spans:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([audio[s:e] for s, e in spans]).astype(np.float32, copy=False)
