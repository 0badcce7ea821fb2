"""load_audio: real clips, every source kind, PyAV-only formats, each bad input, the duration cap."""

from __future__ import annotations

import io
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import av
import librosa
import numpy as np
import pytest
import soundfile as sf

from tests.utils import forbid_resampling
from v1.audio import MIN_AUDIO_SECONDS, SAMPLE_RATE, AudioError, load_audio
from v1.audio.decode import stream_audio

# ----------------------------------------------------------------------------------------------
# Factories


def sine(seconds: float, sr: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encode_soundfile(
    samples: np.ndarray, sr: int, fmt: str = "WAV", subtype: str = "PCM_16"
) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_header(sample_rate: int, *, num_channels: int = 1, data: bytes = b"\0\0" * 800) -> bytes:
    """A 16-bit PCM RIFF/WAVE file written by hand, so any header field can be set."""
    block_align = 2 * num_channels
    fmt = struct.pack(
        "<HHIIHH", 1, num_channels, sample_rate, sample_rate * block_align, block_align, 16
    )
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def encode_pyav(samples: np.ndarray, sr: int, fmt: str, codec: str, layout: str = "mono") -> bytes:
    """Encode mono float samples with PyAV (duplicated to stereo when asked)."""
    channels = 2 if layout == "stereo" else 1
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=sr, layout=layout)
        planes = np.ascontiguousarray(np.tile(samples, (channels, 1)))
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=layout)
        frame.sample_rate = sr
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buf.getvalue()


def silent_flac(seconds: int, sr: int = SAMPLE_RATE) -> bytes:
    """A tiny FLAC of `seconds` of digital silence (~3 bytes per 1000 samples)."""
    buf = io.BytesIO()
    second = np.zeros(sr, np.int16)
    with sf.SoundFile(buf, "w", sr, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds):
            f.write(second)
    return buf.getvalue()


def without_flac_length(flac: bytes) -> bytes:
    """Zero STREAMINFO's 36-bit total-samples field, as a FLAC piped from an encoder has it."""
    assert flac[:4] == b"fLaC"
    data = bytearray(flac)
    start = 8 + 10  # past "fLaC", the block header and the block/frame size fields
    packed = int.from_bytes(data[start : start + 8], "big") & ~((1 << 36) - 1)
    data[start : start + 8] = packed.to_bytes(8, "big")
    return bytes(data)


def dominant_frequency(samples: np.ndarray, sr: int = SAMPLE_RATE) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum)) * sr / len(samples)


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes Python and numpy allocated while `fn` ran."""
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


# ----------------------------------------------------------------------------------------------
# Real clips


@pytest.mark.parametrize(
    ("name", "seconds", "exact_vs_librosa"),
    [
        ("jfk.flac", 11.0, True),  # 44.1 kHz stereo
        ("librispeech/test_audio_0.flac", 4.65, True),  # 16 kHz mono
        ("stereo_diarization.wav", 5.0, True),  # 16 kHz stereo
        ("hotwords.mp3", 4.0, False),  # 44.1 kHz stereo, decoded by ffmpeg, not libsndfile
    ],
)
def test_real_clips_decode_like_librosa(
    audio_dir: Path, name: str, seconds: float, exact_vs_librosa: bool
) -> None:
    audio = load_audio(audio_dir / name)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert audio.shape[0] / SAMPLE_RATE == pytest.approx(seconds, abs=0.03)
    assert np.isfinite(audio).all() and 0.01 < np.abs(audio).max() <= 1.0
    # The reference pipeline the expected Whisper outputs were produced with.
    ref, _ = librosa.load(audio_dir / name, sr=SAMPLE_RATE, mono=True)
    if exact_vs_librosa:
        np.testing.assert_array_equal(audio, ref)
    else:
        assert audio.shape == ref.shape
        np.testing.assert_allclose(audio, ref, atol=1e-4)


def test_stereo_is_the_channel_mean(audio_dir: Path) -> None:
    stereo, sr = sf.read(audio_dir / "stereo_diarization.wav", dtype="float32")
    assert sr == SAMPLE_RATE and stereo.shape[1] == 2
    assert not np.array_equal(stereo[:, 0], stereo[:, 1])
    np.testing.assert_array_equal(
        load_audio(audio_dir / "stereo_diarization.wav"), stereo.mean(axis=1)
    )


def test_path_bytes_and_file_object_agree(audio_dir: Path) -> None:
    path = audio_dir / "jfk.flac"
    from_path = load_audio(path)
    data = path.read_bytes()
    np.testing.assert_array_equal(load_audio(str(path)), from_path)
    np.testing.assert_array_equal(load_audio(data), from_path)
    np.testing.assert_array_equal(load_audio(bytearray(data)), from_path)
    np.testing.assert_array_equal(load_audio(memoryview(data)), from_path)
    with path.open("rb") as f:
        np.testing.assert_array_equal(load_audio(f), from_path)


# ----------------------------------------------------------------------------------------------
# In-memory arrays


def test_array_tuple_resamples_and_mixes() -> None:
    tone = sine(1.0, 8000)
    audio = load_audio((tone, 8000))
    assert audio.dtype == np.float32
    assert audio.shape == (16000,)
    assert dominant_frequency(audio) == pytest.approx(440.0, abs=1.0)
    np.testing.assert_array_equal(audio, librosa.resample(tone, orig_sr=8000, target_sr=16000))

    stereo = np.stack([tone, np.zeros_like(tone)])  # [channels, frames]
    np.testing.assert_array_equal(load_audio((stereo, 8000)), load_audio((stereo.T, 8000)))
    np.testing.assert_allclose(load_audio((stereo, 8000)), audio / 2, atol=1e-6)


def test_array_tuple_at_16k_is_passed_through_and_ints_are_scaled() -> None:
    tone = sine(0.5, SAMPLE_RATE)
    np.testing.assert_array_equal(load_audio((tone, SAMPLE_RATE)), tone)
    pcm = (tone * 32768).astype(np.int16)
    np.testing.assert_allclose(load_audio((pcm, SAMPLE_RATE)), tone, atol=1 / 32768)
    np.testing.assert_array_equal(load_audio((tone.astype(np.float64), SAMPLE_RATE)), tone)


@pytest.fixture
def no_resampling(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_resampling(monkeypatch)


@pytest.mark.usefixtures("no_resampling")
@pytest.mark.parametrize("layout", ["frames", "frames_1", "1_frames"])
def test_16k_mono_float32_is_returned_in_place(layout: str) -> None:
    tone = sine(30.0, SAMPLE_RATE)
    source = {"frames": tone, "frames_1": tone[:, None], "1_frames": tone[None, :]}[layout]
    peak = peak_memory(lambda: load_audio((source, SAMPLE_RATE)))
    audio = load_audio((source, SAMPLE_RATE))
    assert audio.shape == tone.shape and audio.dtype == np.float32 and audio.flags.c_contiguous
    assert np.shares_memory(audio, tone)  # a view of the caller's samples: no copy
    assert peak < 64 * 1024  # the 1.9 MB clip is neither copied nor scanned into a mask


@pytest.mark.usefixtures("no_resampling")
def test_other_16k_arrays_are_converted_once_without_the_collector() -> None:
    tone = sine(1.0, SAMPLE_RATE)
    stereo = np.stack([tone, np.zeros_like(tone)], axis=1)  # [frames, channels]
    np.testing.assert_array_equal(load_audio((stereo, SAMPLE_RATE)), tone / 2)
    np.testing.assert_array_equal(load_audio((stereo.T, SAMPLE_RATE)), tone / 2)
    np.testing.assert_array_equal(load_audio((tone.astype(np.float64), SAMPLE_RATE)), tone)
    pcm = (tone * 32768).astype(np.int16)
    np.testing.assert_allclose(load_audio((pcm, SAMPLE_RATE)), tone, atol=1 / 32768)
    strided = np.repeat(tone, 2)[::2]  # float32 but not contiguous
    audio = load_audio((strided, SAMPLE_RATE))
    assert audio.flags.c_contiguous and not np.shares_memory(audio, strided)
    np.testing.assert_array_equal(audio, tone)


def test_finite_check_at_16k_survives_float32_overflow() -> None:
    # The samples' sum overflows to inf although every sample is finite: still accepted...
    loud = np.full(800, 3e38, np.float32)
    assert np.shares_memory(load_audio((loud, SAMPLE_RATE)), loud)
    # ...and a NaN or inf is caught, alone or hidden by an overflowing sum.
    for bad in (np.nan, np.inf, -np.inf):
        samples = loud.copy()
        samples[400] = bad
        with pytest.raises(AudioError, match="NaN or infinite"):
            load_audio((samples, SAMPLE_RATE))
        quiet = np.zeros(800, np.float32)
        quiet[799] = bad
        with pytest.raises(AudioError, match="NaN or infinite"):
            load_audio((quiet, SAMPLE_RATE))


@pytest.mark.parametrize(("sr", "num_frames"), [(22050, 15435), (48000, 300_001), (11025, 1000)])
def test_resampled_length_and_values_match_librosa(sr: int, num_frames: int) -> None:
    tone = sine(num_frames / sr, sr)
    audio = load_audio((tone, sr))
    expected = librosa.resample(tone, orig_sr=sr, target_sr=SAMPLE_RATE)
    assert audio.shape == (int(np.ceil(num_frames * SAMPLE_RATE / sr)),)
    np.testing.assert_array_equal(audio, expected)


# ----------------------------------------------------------------------------------------------
# Formats only PyAV reads (or that are routed to it)


@pytest.mark.parametrize(
    ("fmt", "codec", "sr", "layout"),
    [
        ("ogg", "libopus", 48000, "stereo"),
        ("webm", "libopus", 48000, "mono"),
        ("ipod", "aac", 44100, "stereo"),  # .m4a
        ("mp3", "libmp3lame", 22050, "mono"),
    ],
)
def test_pyav_encoded_sine_decodes(fmt: str, codec: str, sr: int, layout: str) -> None:
    encoded = encode_pyav(sine(2.0, sr), sr, fmt, codec, layout)
    audio = load_audio(encoded)
    assert audio.dtype == np.float32
    # Codecs add priming/padding of a few tens of ms at most.
    assert audio.shape[0] / SAMPLE_RATE == pytest.approx(2.0, abs=0.1)
    assert dominant_frequency(audio) == pytest.approx(440.0, abs=2.0)
    assert 0.4 < np.abs(audio).max() < 0.6


@pytest.mark.parametrize("version", ["18.1.0", "19.0.2"])
def test_pyav_open_takes_each_versions_arguments(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PyAV 19 dropped av.open's `metadata_errors`: decoding must not pass it there (a
    # TypeError on every MP3 and FLAC), and must still pass it before 19.
    mp3 = encode_pyav(sine(2.0, 22050), 22050, "mp3", "libmp3lame")
    real_open = av.open
    calls: list[dict] = []

    def versioned_open(*args, **kwargs):
        calls.append(kwargs)
        if version.startswith("19") and "metadata_errors" in kwargs:
            raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(av, "__version__", version)
    monkeypatch.setattr(av, "open", versioned_open)
    audio = load_audio(mp3)
    assert dominant_frequency(audio) == pytest.approx(440.0, abs=2.0)
    assert calls and all(("metadata_errors" in c) == version.startswith("18") for c in calls)


def test_truncated_mp3_is_not_padded_to_its_header_length() -> None:
    # libsndfile's MP3 reader pads a cut stream with silence to the Xing header's length;
    # MP3 goes through ffmpeg, which returns what is there.
    mp3 = encode_pyav(sine(2.0, 22050), 22050, "mp3", "libmp3lame")
    audio = load_audio(mp3[: len(mp3) // 2])
    assert audio.shape[0] / SAMPLE_RATE == pytest.approx(1.0, abs=0.15)
    assert dominant_frequency(audio) == pytest.approx(440.0, abs=2.0)


def test_flac_of_unknown_length_decodes_through_pyav() -> None:
    tone = sine(3.0, SAMPLE_RATE)
    flac = without_flac_length(encode_soundfile(tone, SAMPLE_RATE, "FLAC"))
    assert sf.info(io.BytesIO(flac)).frames > 10**18  # libsndfile cannot tell its length
    audio = load_audio(flac)
    np.testing.assert_allclose(audio, tone, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Bad input


def _truncated_wav() -> bytes:
    wav = encode_soundfile(sine(1.0, SAMPLE_RATE), SAMPLE_RATE)
    return wav[: len(wav) // 2]


def _truncated_flac() -> bytes:
    rng = np.random.default_rng(0)
    flac = encode_soundfile(
        (0.1 * rng.standard_normal(32000)).astype(np.float32), SAMPLE_RATE, "FLAC"
    )
    return flac[: len(flac) // 2]


def _float_wav_with_nan() -> bytes:
    samples = sine(0.5, SAMPLE_RATE)
    samples[100] = np.nan
    return encode_soundfile(samples, SAMPLE_RATE, subtype="FLOAT")


BAD_ENCODED = {
    "empty bytes": (lambda: b"", "empty"),
    "one sample wav": (
        lambda: encode_soundfile(np.array([0.5], np.float32), SAMPLE_RATE),
        "too short: 1 sample",
    ),
    "header only wav": (lambda: wav_header(SAMPLE_RATE, data=b""), "no samples"),
    "random bytes": (
        lambda: np.random.default_rng(0).bytes(5000),
        "not a supported audio format",
    ),
    "text": (lambda: b"<html><body>not audio</body></html>\n" * 50, "audio"),
    "truncated wav": (_truncated_wav, "truncated WAV"),
    "truncated flac": (_truncated_flac, "corrupt or truncated FLAC"),
    "nan in float wav": (_float_wav_with_nan, "NaN or infinite"),
    "0 Hz wav header": (lambda: wav_header(0), "sample rate 0 Hz"),
    "0 channel wav header": (lambda: wav_header(SAMPLE_RATE, num_channels=0), "0 channels"),
}


@pytest.mark.parametrize("case", list(BAD_ENCODED))
def test_bad_encoded_input_raises_audio_error(case: str, tmp_path: Path) -> None:
    make, message = BAD_ENCODED[case]
    data = make()
    with pytest.raises(AudioError, match=message):
        load_audio(data)
    path = tmp_path / "input.bin"
    path.write_bytes(data)
    with pytest.raises(AudioError, match=message):  # same verdict from a file
        load_audio(path)


def test_header_only_sanity_of_the_bad_wav_factory() -> None:
    # The hand-written header is valid: with a real rate it decodes, so the 0 Hz case above
    # fails for the rate alone.
    audio = load_audio(wav_header(SAMPLE_RATE))
    assert audio.shape == (800,) and not audio.any()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ((np.array([0.1, np.nan] * 400, np.float32), SAMPLE_RATE), "NaN or infinite"),
        ((np.array([0.1, np.inf] * 400, np.float32), SAMPLE_RATE), "NaN or infinite"),
        ((np.zeros(800, np.float32), 0), "sample rate 0"),
        ((np.zeros(800, np.float32), -16000), "sample rate"),
        ((np.zeros(800, np.float32), float("nan")), "sample rate"),
        ((np.zeros(800, np.float32), True), "sample rate"),
        ((np.zeros(0, np.float32), SAMPLE_RATE), "empty"),
        ((np.zeros(1, np.float32), SAMPLE_RATE), "too short"),
        ((np.zeros((2, 2, 800), np.float32), SAMPLE_RATE), "1-D or 2-D"),
        ((np.array(["a"] * 800), SAMPLE_RATE), "dtype"),
        ((np.zeros(800, np.float32),), "must be \\(samples, sample_rate\\)"),
    ],
)
def test_bad_array_input_raises_audio_error(source: tuple, message: str) -> None:
    with pytest.raises(AudioError, match=message):
        load_audio(source)


def test_minimum_duration_boundary() -> None:
    min_frames = round(MIN_AUDIO_SECONDS * SAMPLE_RATE)
    assert load_audio((np.zeros(min_frames, np.float32), SAMPLE_RATE)).shape == (min_frames,)
    with pytest.raises(AudioError, match="too short"):
        load_audio((np.zeros(min_frames - 1, np.float32), SAMPLE_RATE))


def test_other_source_errors(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path)
    with pytest.raises(AudioError, match="unsupported audio source of type int"):
        load_audio(42)  # type: ignore[arg-type]
    with pytest.raises(AudioError, match="binary mode"):
        load_audio(io.StringIO("RIFF"))  # type: ignore[arg-type]


def test_max_bytes_applies_to_every_encoded_source(tmp_path: Path) -> None:
    wav = encode_soundfile(sine(1.0, SAMPLE_RATE), SAMPLE_RATE)
    path = tmp_path / "a.wav"
    path.write_bytes(wav)
    limit = len(wav) - 1
    for source in (wav, path, io.BytesIO(wav)):
        with pytest.raises(AudioError, match=f"too large: .*limit of {limit} bytes"):
            load_audio(source, max_bytes=limit)
    assert load_audio(io.BytesIO(wav), max_bytes=len(wav)).shape == (16000,)


def test_max_seconds_on_arrays_and_files() -> None:
    tone = sine(6.0, SAMPLE_RATE)
    with pytest.raises(AudioError, match="too long: 6.0 s, more than the limit of 5 s"):
        load_audio((tone, SAMPLE_RATE), max_seconds=5)
    with pytest.raises(AudioError, match="too long"):
        load_audio(encode_soundfile(tone, SAMPLE_RATE), max_seconds=5)
    assert load_audio((tone, SAMPLE_RATE), max_seconds=6).shape == (96000,)


# ----------------------------------------------------------------------------------------------
# Decompression bombs: 20 minutes of silence in ~60 kB would be 77 MB of float32 decoded.


@pytest.fixture(scope="module")
def long_silent_flac() -> bytes:
    flac = silent_flac(20 * 60)
    assert len(flac) < 200_000
    return flac


def test_long_flac_is_rejected_from_its_header(long_silent_flac: bytes) -> None:
    def decode() -> None:
        with pytest.raises(AudioError, match="too long: 1200.0 s"):
            load_audio(long_silent_flac, max_seconds=5)

    assert peak_memory(decode) < 4 << 20


def test_long_flac_of_unknown_length_stops_decoding_at_the_cap(long_silent_flac: bytes) -> None:
    bomb = without_flac_length(long_silent_flac)

    def decode() -> None:
        with pytest.raises(AudioError, match=r"limit of 5 s \(its packets hold at least 5\.\d s\)"):
            load_audio(bomb, max_seconds=5)

    # Fully decoded it would take 77 MB; the cap holds it to a few seconds of samples.
    assert peak_memory(decode) < 8 << 20


class _ListSink:
    def __init__(self, chunk_samples: int) -> None:
        self.chunk_samples = chunk_samples
        self.chunks: list[np.ndarray] = []

    def put(self, chunk: np.ndarray) -> None:
        self.chunks.append(chunk)


@pytest.mark.parametrize(
    ("rate", "fmt", "channels"), [(16_000, "WAV", 1), (44_100, "FLAC", 2), (22_050, "OGG", 2)]
)
def test_streamed_chunks_join_into_the_whole_waveform(rate: int, fmt: str, channels: int) -> None:
    rng = np.random.default_rng(rate)
    audio = (0.1 * rng.standard_normal((int(rate * 4.3), channels))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format=fmt)
    sink = _ListSink(16_000)
    num_samples = stream_audio(buf.getvalue(), sink)
    whole = load_audio(buf.getvalue())
    assert [c.shape[0] for c in sink.chunks] == [16_000] * 4 + [whole.shape[0] - 64_000]
    assert num_samples == whole.shape[0]
    np.testing.assert_array_equal(np.concatenate(sink.chunks), whole)


def test_streaming_holds_only_the_chunks_in_flight(long_silent_flac: bytes) -> None:
    """A 20 min file through a sink that drops its chunks: memory stays at a few chunks,
    where load_audio would hold 77 MB."""

    class Dropping:
        chunk_samples = 30 * 16_000

        def put(self, chunk: np.ndarray) -> None:
            del chunk

    counted: dict[str, int] = {}

    def run() -> None:
        counted["n"] = stream_audio(long_silent_flac, Dropping(), max_seconds=3600)

    assert peak_memory(run) < 16 << 20
    assert counted["n"] == 1200 * 16_000


def test_audio_errors_carry_no_heap_addresses() -> None:
    """PyAV and the io module name their objects with addresses; the message keeps the names."""
    error = AudioError(
        "corrupt flac audio: [Errno 1094995529] Invalid data: "
        "<av.container.InputContainer '<none>' at 0x7f3a12b4c5d0> read from "
        "<_io.BytesIO object at 0x7f3a12b4c5d8>"
    )
    assert "0x" not in str(error)
    assert "<av.container.InputContainer '<none>'>" in str(error)
    assert "<_io.BytesIO>" in str(error)
