"""/v1/audio/transcriptions and /v1/audio/translations with the real whisper-base through the
openai client: every response format, language detection, translation, streaming events, the
upload size cap (413, with and without Content-Length) and a decompression bomb."""

from __future__ import annotations

import asyncio
import io
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, MAX_AUDIO_BYTES, RemoteServer

pytestmark = pytest.mark.timeout(420)

MODEL = "whisper-1"
JFK = AUDIO_DIR / "jfk.flac"
SHORT = AUDIO_DIR / "librispeech" / "test_audio_0.flac"
SHORT_TEXT = "A man said to the universe, Sir, I exist."
SRT_TIME = r"\d\d:\d\d:\d\d,\d\d\d --> \d\d:\d\d:\d\d,\d\d\d"
VTT_TIME = r"\d\d:\d\d:\d\d\.\d\d\d --> \d\d:\d\d:\d\d\.\d\d\d"


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z ]", " ", text.lower()).split())


LONG_STARTS = (1.0, 36.0, 71.0)
"""Where the short clip is placed in an 80 s file: one per 30 s chunk of the test server."""


def _long_flac() -> bytes:
    samples, rate = sf.read(str(SHORT), dtype="float32")
    assert rate == 16_000
    audio = np.zeros(80 * rate, dtype=np.float32)
    for start in LONG_STARTS:
        audio[int(start * rate) : int(start * rate) + samples.shape[0]] = samples
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="FLAC")
    return buf.getvalue()


async def _run_all(server: RemoteServer) -> dict[str, Any]:
    """Every request of the module at once: the engine batches their windows."""
    client = server.async_openai()
    jfk, short = JFK.read_bytes(), SHORT.read_bytes()
    tr = client.audio.transcriptions

    async def raw(**kwargs: Any) -> Any:
        response = await tr.with_raw_response.create(model=MODEL, **kwargs)
        return response.headers.get("content-type", ""), response.parse()

    async def stream(file: tuple[str, bytes] = ("short.flac", short)) -> list[Any]:
        events = await tr.create(model=MODEL, file=file, language="en", stream=True)
        return [event async for event in events]

    long = ("long.flac", _long_flac())

    jobs = {
        "json": tr.create(model=MODEL, file=("jfk.flac", jfk), language="en"),
        "verbose": tr.create(
            model=MODEL,
            file=("short.flac", short),
            response_format="verbose_json",
            timestamp_granularities=["segment"],
        ),
        "srt": raw(file=("short.flac", short), response_format="srt", language="en"),
        "vtt": raw(file=("short.flac", short), response_format="vtt", language="english"),
        "text": raw(file=("short.flac", short), response_format="text", language="en"),
        "translation": client.audio.translations.create(model=MODEL, file=("s.flac", short)),
        "stream": stream(),
        "long": tr.create(
            model=MODEL,
            file=long,
            response_format="verbose_json",
            timestamp_granularities=["segment"],
        ),
        "long_stream": stream(long),
        "words": tr.create(
            model=MODEL,
            file=("short.flac", short),
            language="en",
            response_format="verbose_json",
            timestamp_granularities=["word"],
        ),
        "long_words": tr.create(
            model=MODEL,
            file=long,
            language="en",
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
        ),
        "beam": tr.create(
            model=MODEL,
            file=("short.flac", short),
            language="en",
            extra_body={"beam_size": 5, "best_of": 3, "patience": 1.0},
        ),
    }
    results = await asyncio.gather(*jobs.values())
    await client.close()
    return dict(zip(jobs, results, strict=True))


@pytest.fixture(scope="module")
def results(whisper_server: RemoteServer) -> dict[str, Any]:
    start = time.monotonic()
    out = asyncio.run(_run_all(whisper_server))
    out["elapsed"] = time.monotonic() - start
    return out


def test_json_transcribes_jfk(results: dict[str, Any]) -> None:
    text = results["json"].text
    assert "ask not what your country can do for you" in _words(text)
    assert _words(text).startswith("and so my fellow americans")


def test_verbose_json_detects_language_and_times_segments(results: dict[str, Any]) -> None:
    verbose = results["verbose"]
    assert verbose.language == "english"  # detected: no language was given
    assert verbose.task == "transcribe"
    duration = sf.info(str(SHORT)).duration
    assert verbose.duration == pytest.approx(duration, abs=0.01)
    assert _words(verbose.text) == _words(SHORT_TEXT)
    segments = verbose.segments
    assert segments and [s.id for s in segments] == list(range(len(segments)))
    for seg in segments:
        assert 0 <= seg.start <= seg.end <= duration + 0.5
        assert seg.tokens and seg.avg_logprob < 0
    assert _words(" ".join(s.text for s in segments)) == _words(SHORT_TEXT)


def test_srt_and_vtt_are_plain_subtitle_bodies(results: dict[str, Any]) -> None:
    content_type, srt = results["srt"]
    assert content_type.startswith("text/plain")
    lines = srt.strip().split("\n")
    assert lines[0] == "1" and re.fullmatch(SRT_TIME, lines[1])
    assert _words(" ".join(lines[2:])) == _words(SHORT_TEXT)
    content_type, vtt = results["vtt"]
    assert content_type.startswith("text/vtt")
    assert vtt.startswith("WEBVTT\n\n")
    cue = vtt.split("\n\n", 1)[1].strip().split("\n")
    assert re.fullmatch(VTT_TIME, cue[0])
    assert _words(" ".join(cue[1:])) == _words(SHORT_TEXT)


def test_text_is_plain(results: dict[str, Any]) -> None:
    content_type, text = results["text"]
    assert content_type.startswith("text/plain")
    assert isinstance(text, str) and not text.startswith("{")
    assert _words(text) == _words(SHORT_TEXT)


def test_translation_of_english_speech_is_english(results: dict[str, Any]) -> None:
    assert "man said to the universe" in _words(results["translation"].text)


def test_long_audio_goes_through_in_chunks(results: dict[str, Any]) -> None:
    """80 s against the test server's 30 s chunks: three chunks transcribed one after another,
    joined into one text with segment times on the file's clock."""
    phrase = _words(SHORT_TEXT)
    long = results["long"]
    assert _words(long.text).count(phrase) == 3, long.text
    assert long.language == "english" and abs(long.duration - 80.0) < 0.01
    starts = [seg.start for seg in long.segments]
    assert starts == sorted(starts) and [seg.id for seg in long.segments] == list(
        range(len(starts))
    )
    for k in range(3):  # each chunk's segments on the file's clock, inside that chunk
        assert any(30 * k <= start < 30 * (k + 1) for start in starts), (k, starts)
    assert all(seg.end <= 80.0 for seg in long.segments)
    done = results["long_stream"][-1]
    assert done.type == "transcript.text.done"
    assert _words(done.text).count(phrase) == 3


def test_word_timestamps(results: dict[str, Any]) -> None:
    """timestamp_granularities=["word"]: words as OpenAI returns them (no leading space, no
    segments unless asked for), in order, inside the audio."""
    verbose = results["words"]
    assert verbose.segments is None
    words = verbose.words
    assert [w.word for w in words] == SHORT_TEXT.split()
    times = [t for w in words for t in (w.start, w.end)]
    assert times == sorted(times) and times[0] >= 0 and times[-1] <= verbose.duration
    exist = words[-1]
    assert 3.3 < exist.start < exist.end < 4.7, exist  # "exist." is spoken at about 3.5-4.2 s


def test_word_timestamps_of_long_audio_are_on_the_file_clock(results: dict[str, Any]) -> None:
    """Words of each 30 s server chunk shifted by the chunk's offset: each "man" sits where
    its copy of the clip was placed, as it does in the clip alone."""
    long, alone = results["long_words"], results["words"]
    assert long.segments and long.words
    times = [t for w in long.words for t in (w.start, w.end)]
    assert times == sorted(times) and times[-1] <= 80.0
    (man,) = [w for w in alone.words if w.word == "man"]
    mans = [w for w in long.words if w.word == "man"]
    assert len(mans) == 3
    for start, word in zip(LONG_STARTS, mans, strict=True):
        assert abs(word.start - (start + man.start)) < 0.3, (start, word)


def test_stream_events(results: dict[str, Any]) -> None:
    events = results["stream"]
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done"
    assert len(deltas) >= 3  # token by token, not one blob at the end
    assert _words("".join(d.delta for d in deltas)) == _words(done.text) == _words(SHORT_TEXT)


def test_audio_seconds_metric(results: dict[str, Any], whisper_server: RemoteServer) -> None:
    short = sf.info(str(SHORT)).duration
    expected = sf.info(str(JFK)).duration + 6 * short + 2 * 80
    seconds = whisper_server.metric('v1_audio_seconds_processed_total{model_name="whisper-1"}')
    assert seconds >= expected - 0.1


def _raw_upload(server: RemoteServer, headers: str, body_parts: Iterator[bytes]) -> bytes:
    """Sends a request over a raw socket, stops sending when `body_parts` ends (the body may be
    incomplete) and returns the first bytes of the response."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{headers}\r\n".encode()
        )
        for part in body_parts:
            sock.sendall(part)
        # Headers and body may arrive in separate segments: read until the body is complete
        # (Content-Length) or the server closes the connection.
        reply = b""
        while True:
            data = sock.recv(65536)
            reply += data
            head, sep, body = reply.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            if not data or (sep and length and len(body) >= int(length.group(1))):
                return reply


BOUNDARY = "v1testboundary"
FORM_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
    "Content-Type: audio/wav\r\n\r\n"
).encode()


def test_oversize_upload_is_413(whisper_server: RemoteServer) -> None:
    client = whisper_server.openai(timeout=60)
    big = b"\0" * (MAX_AUDIO_BYTES + (1 << 20) + 1000)  # past the cap + form overhead
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model=MODEL, file=("big.wav", big))
    assert info.value.status_code == 413
    # A declared 1 GB body is refused before it is sent.
    reply = _raw_upload(whisper_server, "Content-Length: 1000000000\r\n", iter([FORM_HEAD]))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # Chunked, no Content-Length: refused while the body streams in. The client stops after
    # 4 MiB of a body that never ends, so a 413 proves the server counted as it read.
    mib = b"\0" * (1 << 20)

    def chunked() -> Iterator[bytes]:
        for data in (FORM_HEAD, mib, mib, mib, mib):
            yield f"{len(data):x}\r\n".encode() + data + b"\r\n"

    reply = _raw_upload(whisper_server, "Transfer-Encoding: chunked\r\n", chunked())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = reply.split(b"\r\n\r\n", 1)[1]
    assert b'"error"' in body
    with whisper_server.http() as http:
        assert http.get("/health").status_code == 200


def test_decompression_bomb_is_400_quickly(whisper_server: RemoteServer) -> None:
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=1000, channels=1, format="FLAC") as f:
        silence = np.zeros(1000 * 3600, dtype=np.int16)
        for _ in range(4):  # four hours of silence: a few kB of FLAC
            f.write(silence)
    data = buf.getvalue()
    assert len(data) < 200_000
    start = time.monotonic()
    with whisper_server.http(timeout=60) as http:
        response = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("bomb.flac", data, "audio/flac")},
            data={"model": MODEL},
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "too long" in error["message"]
    assert time.monotonic() - start < 5


def test_beam_size_form_fields(results: dict[str, Any], whisper_server: RemoteServer) -> None:
    assert _words(results["beam"].text) == "a man said to the universe sir i exist"
    with whisper_server.http() as http:
        files = {"file": ("short.flac", SHORT.read_bytes())}
        for fields in ({"beam_size": "0"}, {"beam_size": "5", "stream": "true"}):
            response = http.post(
                "/v1/audio/transcriptions", files=files, data={"model": MODEL, **fields}
            )
            assert response.status_code == 400, response.text
            assert "beam_size" in response.json()["error"]["message"]
