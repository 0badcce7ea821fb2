"""faster-whisper's clip_timestamps and batch_size as form fields of /v1/audio/transcriptions
and /v1/audio/translations (real whisper-base, openai client and httpx): clip spans decoded
alone on the upload's clock, across the server's 30 s chunks; batch_size decoding the VAD
chunks of one upload each on its own (one segment per chunk without timestamps), with the
sequential text, and streaming their text in order."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, WHISPER_DIR, RemoteServer
from tests.utils import needs_assets

pytestmark = [pytest.mark.timeout(420), needs_assets(WHISPER_DIR, AUDIO_DIR)]

MODEL = "whisper-1"
SR = 16_000


def _clip(name: str) -> np.ndarray:
    samples, rate = sf.read(str(AUDIO_DIR / name), dtype="float32")
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if rate != SR:
        import soxr

        samples = soxr.resample(samples, rate, SR).astype(np.float32)
    return samples


def _flac(*parts: np.ndarray | float) -> bytes:
    """Clips and seconds of silence, in order, as one 16 kHz FLAC upload."""
    audio = np.concatenate(
        [p if isinstance(p, np.ndarray) else np.zeros(int(p * SR), np.float32) for p in parts]
    )
    buf = io.BytesIO()
    sf.write(buf, audio, SR, format="FLAC")
    return buf.getvalue()


def _words(text: str) -> list[str]:
    """Words without case or punctuation (a comma may differ between two decodings)."""
    return re.sub(r"[^\w\s]", "", text.lower()).split()


@pytest.fixture(scope="module")
def clips() -> dict[str, np.ndarray]:
    return {
        "jfk": _clip("jfk.flac"),
        "a0": _clip("librispeech/test_audio_0.flac"),
        "a1": _clip("librispeech/test_audio_1.flac"),
    }


def test_clip_timestamps_decode_only_their_spans_across_chunks(
    whisper_server: RemoteServer, clips: dict[str, np.ndarray]
) -> None:
    """The server cuts uploads into 30 s chunks: the spans 10-21.5 s (JFK, chunk 0) and 31.5 s
    to the end (a1, chunk 1) are decoded; a0 at 0-4.7 s is not."""
    a0, jfk, a1 = clips["a0"], clips["jfk"], clips["a1"]
    upload = _flac(a0, 10 - a0.size / SR, jfk, 32 - 10 - jfk.size / SR, a1, 1.0)
    client = whisper_server.openai()
    clipped = client.audio.transcriptions.create(
        model=MODEL,
        file=("clips.flac", upload),
        language="en",
        response_format="verbose_json",
        extra_body={"clip_timestamps": "10,21.5,31.5"},
    )
    assert "universe" not in clipped.text  # a0, outside every span
    assert "fellow Americans" in clipped.text and "matter" in clipped.text
    starts = [s.start for s in clipped.segments]
    assert starts == sorted(starts) and starts[0] >= 10.0
    assert all(s.end <= 21.5 or s.start >= 31.5 for s in clipped.segments)
    assert any(s.start >= 31.5 and "matter" in s.text for s in clipped.segments)
    # Translation takes the field too: a span before a0 ends holds only a0.
    translated = client.audio.translations.create(
        model=MODEL, file=("clips.flac", upload), extra_body={"clip_timestamps": "0,5"}
    )
    assert "universe" in translated.text and "fellow" not in translated.text


@pytest.fixture(scope="module")
def long_chunk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """whisper-base with 60 s upload chunks: a 48 s upload is one chunk, and its VAD speech
    chunks are what batch_size decodes at once."""
    server = RemoteServer(
        "whisper_60s",
        str(WHISPER_DIR),
        ["--served-model-name", MODEL, "--audio-chunk-seconds", "60", "--max-num-seqs", "8"],
        tmp_path_factory.mktemp("whisper_60s"),
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_batch_size_decodes_vad_chunks_apart_with_the_sequential_text(
    long_chunk_server: RemoteServer, clips: dict[str, np.ndarray]
) -> None:
    a0, jfk = clips["a0"], clips["jfk"]
    upload = _flac(a0, 31.0, jfk, 1.0)  # 31 s apart: two VAD chunks of at most 30 s
    jfk_start = a0.size / SR + 31.0
    client = long_chunk_server.openai()
    fields = {"vad_filter": "true", "without_timestamps": "true"}

    def verbose(**extra: str) -> object:
        return client.audio.transcriptions.create(
            model=MODEL,
            file=("two.flac", upload),
            language="en",
            response_format="verbose_json",
            extra_body={**fields, **extra},
        )

    batched = verbose(batch_size="2")
    sequential = verbose()
    # Batched: each VAD chunk is decoded on its own, one segment each, where its speech is.
    assert len(batched.segments) == 2
    first, second = batched.segments
    assert first.start < 1.0 and first.end < jfk_start
    assert abs(second.start - jfk_start) < 1.0 and "fellow" in second.text
    # Sequential: the speech joined is one window, one segment.
    assert len(sequential.segments) == 1
    assert _words(batched.text) == _words(sequential.text)

    # Streamed, the chunks' text comes in audio order.
    with (
        httpx.Client(base_url=long_chunk_server.url, timeout=120) as http,
        http.stream(
            "POST",
            "/v1/audio/transcriptions",
            files={"file": ("two.flac", upload)},
            data={"model": MODEL, "language": "en", "stream": "true", "batch_size": "2", **fields},
        ) as response,
    ):
        assert response.status_code == 200
        events = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    deltas = "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta")
    done = next(e for e in events if e["type"] == "transcript.text.done")
    assert deltas == done["text"] and _words(done["text"]) == _words(batched.text)
    assert done["text"].index("universe") < done["text"].index("fellow")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"clip_timestamps": "3,1"}, "must increase"),
        ({"clip_timestamps": "a"}, "clip_timestamps"),
        ({"batch_size": "0"}, "batch_size"),
        ({"clip_timestamps": "0,5", "batch_size": "2"}, "cannot be combined"),
    ],
)
@pytest.mark.parametrize("endpoint", ["transcriptions", "translations"])
def test_bad_clip_and_batch_fields_are_400(
    whisper_server: RemoteServer, endpoint: str, fields: dict[str, str], message: str
) -> None:
    short = Path(AUDIO_DIR / "librispeech" / "test_audio_0.flac").read_bytes()
    with whisper_server.http() as http:
        response = http.post(
            f"/v1/audio/{endpoint}",
            files={"file": ("short.flac", short)},
            data={"model": MODEL, **fields},
        )
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
