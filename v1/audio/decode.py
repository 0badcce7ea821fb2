"""Audio decoding: a path, bytes, file-like or (array, rate) -> float32 mono 16 kHz.

soundfile first, PyAV for what libsndfile cannot open; blocks are mixed and resampled (soxr)
as they arrive. Duration is capped twice: the declared length before decoding (constant
memory), the decoded length as blocks arrive. 16 kHz mono float32 arrays come back uncopied.
"""

from __future__ import annotations

import contextvars
import io
import math
import numbers
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeAlias

import numpy as np

from v1 import envs

if TYPE_CHECKING:
    import soundfile as sf

# The decoders (soundfile, PyAV, soxr) are imported where they are used, so a text-only
# server (and a GPU image without them) never loads them.

SAMPLE_RATE = 16_000
"""Rate of every waveform `load_audio` returns (Whisper's)."""

MIN_AUDIO_SECONDS = 0.01
"""Shortest accepted audio: one Whisper hop (10 ms); anything shorter yields no mel frame."""

MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 768_000
"""Accepted source sample rates (Hz), bounds included."""

_BLOCK_FRAMES = 65_536
# libsndfile reports this frame count for streams of unknown length (e.g. a piped FLAC); it
# cannot read those through soundfile's seek-after-read, so they go to PyAV.
_SF_UNKNOWN_FRAMES = 2**63 - 1
# libsndfile's MP3 reader pads truncated streams with silence and logs to stderr; ffmpeg is
# the better MP3 decoder.
_PYAV_FORMATS = frozenset({"MP3"})
# Compressed formats libsndfile reads whose header length may be absent or false: their
# packets are counted (demuxed, not decoded) before decoding.
_DEMUX_CHECKED_FORMATS = frozenset({"FLAC", "OGG"})
# RIFF sizes that streaming writers leave in place of the real one.
_WAV_UNKNOWN_SIZES = (0, 0xFFFFFFFF)
_WAV_PLACEHOLDER_MIN = 0x7FFFF000

AudioSource: TypeAlias = (
    str | os.PathLike[str] | bytes | bytearray | memoryview | BinaryIO | tuple[np.ndarray, float]
)


class AudioError(ValueError):
    """Audio input that cannot be used; the message says why, in terms a caller can act on.

    Library errors name their in-memory objects (`<av.InputContainer '<none>' at 0x7f...>`):
    the heap addresses are cut from the message (they help nobody and leak the server's
    memory layout)."""

    def __init__(self, message: str) -> None:
        message = _OBJECT_AT.sub(lambda m: f"<{m.group(1)}>", message)
        super().__init__(_AT_ADDRESS.sub("", message))


_OBJECT_AT = re.compile(r"<([^<>]*?)\s+(?:object\s+)?at\s+0x[0-9a-fA-F]+>")
_AT_ADDRESS = re.compile(r"\s+at\s+0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


class ChunkSink(Protocol):
    """Where `stream_audio` hands the waveform, `chunk_samples` 16 kHz samples at a time (the
    last chunk may be shorter). `put` may block: the decoder then waits, which is what bounds
    the memory of a long file to the chunks in flight."""

    chunk_samples: int

    def put(self, chunk: np.ndarray) -> None: ...


_SINK: contextvars.ContextVar[ChunkSink | None] = contextvars.ContextVar(
    "v1_audio_sink", default=None
)
"""The sink of the `stream_audio` call running in this thread (None: `load_audio` collects)."""


def stream_audio(
    source: AudioSource,
    sink: ChunkSink,
    *,
    max_seconds: float = envs.V1_MAX_AUDIO_SECONDS,
    max_bytes: int = envs.V1_MAX_AUDIO_BYTES,
) -> int:
    """`load_audio`, but the waveform goes to `sink` in chunks as it is decoded instead of
    being returned whole; the chunks joined equal `load_audio`'s array. Every check of
    `load_audio` applies; one that fails mid-stream raises after the chunks before it were
    handed over. Returns the number of samples."""
    counter = _CountingSink(sink)
    token = _SINK.set(counter)
    try:
        load_audio(source, max_seconds=max_seconds, max_bytes=max_bytes)
    finally:
        _SINK.reset(token)
    return counter.num_samples


class _CountingSink:
    def __init__(self, sink: ChunkSink) -> None:
        self.sink = sink
        self.chunk_samples = sink.chunk_samples
        self.num_samples = 0

    def put(self, chunk: np.ndarray) -> None:
        self.num_samples += chunk.shape[0]
        self.sink.put(chunk)


def load_audio(
    source: AudioSource,
    *,
    max_seconds: float = envs.V1_MAX_AUDIO_SECONDS,
    max_bytes: int = envs.V1_MAX_AUDIO_BYTES,
) -> np.ndarray:
    """Decode `source` to a float32 mono waveform at 16 kHz.

    `source` is a file path, encoded bytes, a binary file-like object, or `(samples,
    sample_rate)` with samples of shape [frames], [frames, channels] or [channels, frames] (the
    shorter axis is taken as channels). Channels are averaged; integer samples are scaled to
    [-1, 1). Mono float32 samples at 16 kHz are returned as a view of the same memory (nothing
    to resample or convert, so no copy). `max_bytes` bounds encoded input only. Raises
    `AudioError` for every bad input.
    """
    if isinstance(source, tuple):
        return _load_array(source, max_seconds)
    data = _read_encoded(source, max_bytes)
    if not isinstance(source, (str, os.PathLike)):
        return _decode_bytes(data, max_seconds)
    try:
        return _decode_bytes(data, max_seconds)
    except AudioError as e:  # name the file: a batch of paths must say which one is bad
        raise AudioError(f"{os.fspath(source)}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Sources


def _read_encoded(source: object, max_bytes: int) -> bytes:
    """The encoded bytes of a path, bytes-like or binary file-like, at most `max_bytes` of them."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if not path.is_file():
                raise AudioError(f"audio path {str(path)!r} is not a regular file")
            if size > max_bytes:
                raise AudioError(_too_many_bytes(size, max_bytes))
            with path.open("rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError as e:
            raise AudioError(f"audio file not found: {str(path)!r}") from e
        except OSError as e:
            raise AudioError(f"cannot read audio file {str(path)!r}: {e}") from e
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source) if not isinstance(source, bytes) else source
    elif hasattr(source, "read"):
        data = source.read(max_bytes + 1)  # type: ignore[attr-defined]
        if not isinstance(data, bytes):
            raise AudioError(
                f"audio file object returned {type(data).__name__}, not bytes; open it in binary mode"
            )
    else:
        raise AudioError(
            f"unsupported audio source of type {type(source).__name__}: pass a path, bytes, a "
            "binary file object or a (samples, sample_rate) tuple"
        )
    if len(data) > max_bytes:
        raise AudioError(_too_many_bytes(len(data), max_bytes))
    if not data:
        raise AudioError("audio input is empty (0 bytes)")
    return data


def _too_many_bytes(size: int, max_bytes: int) -> str:
    # Streams are read up to max_bytes + 1, so that is all a caller can be told about them.
    shown = "" if size == max_bytes + 1 else f"{size} bytes, "
    return f"encoded audio is too large: {shown}more than the limit of {max_bytes} bytes"


def _load_array(source: tuple, max_seconds: float) -> np.ndarray:
    """Check and convert an in-memory `(samples, sample_rate)` pair."""
    if len(source) != 2:
        raise AudioError(f"audio tuple must be (samples, sample_rate), got {len(source)} items")
    samples, sample_rate = source
    sample_rate = _check_sample_rate(sample_rate)
    try:
        samples = np.asarray(samples)
    except (TypeError, ValueError) as e:
        raise AudioError(f"audio samples are not an array: {e}") from e
    if samples.size == 0:
        raise AudioError("audio input is empty (0 samples)")
    if samples.ndim == 1:
        samples = samples[:, None]
    elif samples.ndim == 2:
        if samples.shape[0] <= samples.shape[1]:
            samples = samples.T  # [channels, frames] -> [frames, channels]
    else:
        raise AudioError(
            f"audio samples must be 1-D or 2-D (frames and channels), got shape {samples.shape}"
        )
    if samples.shape[0] > max_seconds * sample_rate:
        raise AudioError(_too_long(samples.shape[0] / sample_rate, max_seconds))
    samples = _to_float32(samples)
    if sample_rate == SAMPLE_RATE:
        return _checked_16k(samples)
    collector = _MonoCollector(sample_rate, max_seconds)
    for start in range(0, samples.shape[0], _BLOCK_FRAMES):
        collector.add(samples[start : start + _BLOCK_FRAMES])
    return collector.finish()


def _checked_16k(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] float32 samples at 16 kHz -> [frames] mono, checked, C-contiguous.

    Nothing to resample: mono float32 comes back as a view of the caller's array (no copy),
    more channels as their mean (what `_MonoCollector` computes, without its blocks).
    """
    if samples.shape[0] < MIN_AUDIO_SECONDS * SAMPLE_RATE:
        raise AudioError(_too_short(samples.shape[0], SAMPLE_RATE))
    if samples.shape[1] == 1:
        mono = np.ascontiguousarray(samples[:, 0])
    else:
        mono = np.ascontiguousarray(samples.T.mean(axis=0))
    # sum() reads the samples once and allocates nothing; it is finite whenever every sample
    # is, except for float32 overflow, which the exact (allocating) check then rules out.
    with np.errstate(over="ignore", invalid="ignore"):
        total = mono.sum()
    if not np.isfinite(total) and not np.isfinite(mono).all():
        raise AudioError("audio contains NaN or infinite sample values")
    return mono


def _to_float32(samples: np.ndarray) -> np.ndarray:
    """Float samples as float32; integer PCM scaled to [-1, 1) the way soundfile does."""
    kind = samples.dtype.kind
    if kind == "f":
        return samples.astype(np.float32, copy=False)
    if kind == "i":
        scale = float(2 ** (8 * samples.dtype.itemsize - 1))
        return (samples / scale).astype(np.float32)
    if kind == "u":
        offset = float(2 ** (8 * samples.dtype.itemsize - 1))
        return ((samples - offset) / offset).astype(np.float32)
    raise AudioError(f"audio samples must be float or integer PCM, got dtype {samples.dtype}")


def _check_sample_rate(sample_rate: object) -> float:
    valid = (
        isinstance(sample_rate, numbers.Real)
        and not isinstance(sample_rate, bool)
        and math.isfinite(sample_rate)
        and MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE
    )
    if not valid:
        raise AudioError(
            f"invalid audio sample rate {sample_rate!r} Hz: expected a number from "
            f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE}"
        )
    return float(sample_rate)  # type: ignore[arg-type]


def _too_long(seconds: float, max_seconds: float) -> str:
    return f"audio is too long: {seconds:.1f} s, more than the limit of {max_seconds:g} s"


def _too_short(num_frames: int, sample_rate: float) -> str:
    return (
        f"audio is too short: {num_frames} sample(s) at {sample_rate:g} Hz "
        f"({1000 * num_frames / sample_rate:.2f} ms); at least {1000 * MIN_AUDIO_SECONDS:g} ms "
        "is needed"
    )


# ----------------------------------------------------------------------------------------------
# Streaming mono mix, checks and resampling


class _MonoCollector:
    """Takes decoded [frames, channels] float32 blocks; mixes, checks and resamples each one.

    Mono is the channel mean and resampling is soxr HQ streamed, which is bit-identical to
    `librosa.load(..., sr=16000, mono=True)` on the same decoded samples.
    """

    def __init__(self, sample_rate: float, max_seconds: float) -> None:
        self.sample_rate = sample_rate
        self.max_seconds = max_seconds
        self.num_frames = 0
        self._max_frames = max_seconds * sample_rate
        self._chunks: list[np.ndarray] = []
        self._sink = _SINK.get()
        self._num_pending = 0
        """16 kHz samples in _chunks (with a sink: not yet handed over)."""
        self._num_out = 0
        """16 kHz samples handed to the sink."""
        import soxr

        self._stream = (
            None
            if sample_rate == SAMPLE_RATE
            else soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        )

    def add(self, block: np.ndarray) -> None:
        """Append one block of shape [frames, channels]; raises once past the duration cap."""
        self.num_frames += block.shape[0]
        if self.num_frames > self._max_frames:
            raise AudioError(
                f"audio is too long: more than the limit of {self.max_seconds:g} s (stopped "
                f"decoding at {self.num_frames / self.sample_rate:.1f} s)"
            )
        if not np.isfinite(block).all():
            raise AudioError("audio contains NaN or infinite sample values")
        mono = np.ascontiguousarray(block.T.mean(axis=0) if block.shape[1] > 1 else block[:, 0])
        self._append(mono if self._stream is None else self._stream.resample_chunk(mono))

    def _append(self, samples: np.ndarray) -> None:
        self._chunks.append(samples)
        self._num_pending += samples.shape[0]
        if self._sink is not None and self._num_pending >= self._sink.chunk_samples:
            self._hand_over(final=False)

    def _hand_over(self, final: bool) -> None:
        """Gives the sink every full chunk (and, when `final`, the rest)."""
        assert self._sink is not None
        size = self._sink.chunk_samples
        data = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        start = 0
        while data.shape[0] - start >= size or (final and start < data.shape[0]):
            chunk = data[start : start + size].copy()
            self._sink.put(chunk)
            start += chunk.shape[0]
        self._num_out += start
        self._chunks = [data[start:]] if start < data.shape[0] else []
        self._num_pending = data.shape[0] - start

    def finish(self) -> np.ndarray:
        """The whole waveform at 16 kHz; raises if it is empty or shorter than the minimum."""
        if self.num_frames == 0:
            raise AudioError("audio contains no samples")
        if self.num_frames < MIN_AUDIO_SECONDS * self.sample_rate:
            raise AudioError(_too_short(self.num_frames, self.sample_rate))
        if self._stream is None:
            if self._sink is not None:
                return self._finish_sink(self.num_frames)
            return np.concatenate(self._chunks)
        self._chunks.append(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))
        # librosa.resample's output length: soxr may come up one sample short of it.
        num_out = int(np.ceil(self.num_frames * (float(SAMPLE_RATE) / self.sample_rate)))
        if self._sink is not None:
            return self._finish_sink(num_out)
        return _fix_length(np.concatenate(self._chunks), num_out)

    def _finish_sink(self, num_out: int) -> np.ndarray:
        rest = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self._chunks = [_fix_length(rest, max(num_out - self._num_out, 0))]
        self._hand_over(final=True)
        return np.zeros(0, np.float32)  # the waveform went to the sink


def _fix_length(samples: np.ndarray, size: int) -> np.ndarray:
    """`librosa.util.fix_length` for 1-D audio (cut, or zero-padded at the end), without
    importing librosa (and numba) on a server's decoding thread."""
    if samples.shape[0] >= size:
        return samples[:size]
    return np.pad(samples, (0, size - samples.shape[0]))


# ----------------------------------------------------------------------------------------------
# Decoders


def _decode_bytes(data: bytes, max_seconds: float) -> np.ndarray:
    """soundfile first (exact, what librosa uses), PyAV for what it cannot or should not read."""
    import soundfile as sf

    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        _check_wav(data)
    try:
        sf_file = sf.SoundFile(io.BytesIO(data))
    except sf.SoundFileError as e:
        return _decode_pyav(data, max_seconds, soundfile_error=e)
    with sf_file:
        if sf_file.format in _PYAV_FORMATS or sf_file.frames == _SF_UNKNOWN_FRAMES:
            return _decode_pyav(data, max_seconds, soundfile_error=None)
        return _decode_soundfile(sf_file, max_seconds, data)


def _decode_soundfile(sf_file: sf.SoundFile, max_seconds: float, data: bytes) -> np.ndarray:
    import soundfile as sf

    sample_rate = _check_sample_rate(sf_file.samplerate)
    if sf_file.frames > max_seconds * sample_rate:  # header length: reject before decoding
        raise AudioError(_too_long(sf_file.frames / sample_rate, max_seconds))
    if sf_file.format in _DEMUX_CHECKED_FORMATS:
        check_packet_duration(data, max_seconds)  # a header may understate the length
    collector = _MonoCollector(sample_rate, max_seconds)
    try:
        for block in sf_file.blocks(_BLOCK_FRAMES, dtype="float32", always_2d=True):
            collector.add(block)
    except sf.SoundFileError as e:
        raise AudioError(f"corrupt or truncated {sf_file.format} audio: {e}") from e
    return collector.finish()


def _open_container(av: Any, data: bytes) -> Any:
    """`av.open` of in-memory bytes for reading. PyAV before 19 decodes container metadata
    strictly unless told to ignore bad bytes (`metadata_errors`); 19 dropped that argument."""
    if int(av.__version__.split(".")[0]) < 19:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    return av.open(io.BytesIO(data), mode="r")


def check_packet_duration(data: bytes, max_seconds: float) -> float | None:
    """Seconds of audio the container's packets hold, summed without decoding (constant
    memory, about 0.1 s per hour of FLAC); raises AudioError as soon as the sum passes
    `max_seconds`. None when the container cannot be read or its packets carry no durations
    (the decoded length is still counted while decoding)."""
    import av

    try:
        container = _open_container(av, data)
    except av.FFmpegError:
        return None  # the decoder says what is wrong with it
    with container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        time_base = stream.time_base
        if not time_base:
            return None
        limit = max_seconds / float(time_base)
        total = 0
        try:
            for packet in container.demux(stream):
                if packet.duration is None or packet.size == 0:
                    continue
                total += packet.duration
                if total > limit:
                    raise AudioError(
                        f"audio is too long: more than the limit of {max_seconds:g} s (its "
                        f"packets hold at least {float(total * time_base):.1f} s)"
                    )
        except av.FFmpegError:
            return None  # corrupt: the decoder says where
        return float(total * time_base) if total else None


def _decode_pyav(
    data: bytes, max_seconds: float, *, soundfile_error: sf.SoundFileError | None
) -> np.ndarray:
    import av

    check_packet_duration(data, max_seconds)
    try:
        container = _open_container(av, data)
    except av.FFmpegError as e:
        raise AudioError(_undecodable(soundfile_error, e)) from e
    with container:
        if not container.streams.audio:
            raise AudioError(f"no audio stream found in the input ({container.format.name})")
        stream = container.streams.audio[0]
        collector: _MonoCollector | None = None
        # Format conversion only (rate and layout kept): any sample format -> planar float32.
        to_float = av.AudioResampler(format="fltp")
        try:
            for frame in container.decode(stream):
                if collector is None:
                    collector = _MonoCollector(_check_sample_rate(frame.sample_rate), max_seconds)
                elif frame.sample_rate != collector.sample_rate:
                    raise AudioError(
                        f"audio sample rate changes mid-stream ({collector.sample_rate:g} Hz -> "
                        f"{frame.sample_rate} Hz)"
                    )
                for out in to_float.resample(frame):
                    collector.add(out.to_ndarray().T)  # [channels, frames] -> [frames, channels]
            if collector is not None:
                for out in to_float.resample(None):
                    collector.add(out.to_ndarray().T)
        except AudioError:
            raise
        except (av.FFmpegError, ValueError) as e:  # ValueError: PyAV's resampler on odd frames
            raise AudioError(f"corrupt or truncated {stream.codec_context.name} audio: {e}") from e
    if collector is None:
        raise AudioError("audio contains no samples")
    return collector.finish()


def _undecodable(soundfile_error: sf.SoundFileError | None, pyav_error: Exception) -> str:
    # Both libraries name their in-memory input ("<_io.BytesIO object at 0x...>", "'<none>'")
    # and ffmpeg its error code: only the reasons say anything to the user.
    reasons = f"ffmpeg: {getattr(pyav_error, 'strerror', None) or pyav_error}"
    if soundfile_error is not None:
        reason = re.sub(r"^Error opening <[^>]*>: ", "", str(soundfile_error)).rstrip(".")
        reasons = f"libsndfile: {reason}; {reasons}"
    return f"could not decode audio: not a supported audio format, or corrupt ({reasons})"


def _check_wav(data: bytes) -> None:
    """Catch what libsndfile lets through or words badly in a RIFF/WAVE file.

    libsndfile reads a data chunk cut short without complaint (it shortens the stream), and
    rejects a zero sample rate with an internal error message. (It shortens AIFF/AU/W64 files
    cut short too; those rare containers decode as far as they go.)
    """
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if chunk_id == b"fmt " and size >= 16 and body + 16 <= len(data):
            num_channels = int.from_bytes(data[body + 2 : body + 4], "little")
            sample_rate = int.from_bytes(data[body + 4 : body + 8], "little")
            if num_channels == 0:
                raise AudioError("invalid WAV header: 0 channels")
            if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
                raise AudioError(
                    f"invalid audio sample rate {sample_rate} Hz in the WAV header: expected "
                    f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE}"
                )
        elif chunk_id == b"data":
            available = len(data) - body
            unknown = size in _WAV_UNKNOWN_SIZES or size >= _WAV_PLACEHOLDER_MIN
            if not unknown and size > available:
                raise AudioError(
                    f"truncated WAV file: the data chunk declares {size} bytes but only "
                    f"{available} are present"
                )
            return
        pos = body + size + (size & 1)
