"""faster-whisper's transcription options as form fields of /v1/audio/transcriptions (real
whisper-base, openai client and httpx): words with probabilities in verbose_json, vad_filter, prefix, suppress_tokens, and 400s for malformed values."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, RemoteServer

pytestmark = pytest.mark.timeout(420)

MODEL = "whisper-1"
SHORT = AUDIO_DIR / "librispeech" / "test_audio_0.flac"


def _padded_flac() -> bytes:
    """6 s of silence, the short clip, 6 s of silence."""
    samples, rate = sf.read(str(SHORT), dtype="float32")
    gap = np.zeros(6 * rate, dtype=np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.concatenate([gap, samples, gap]), rate, format="FLAC")
    return buf.getvalue()


def test_words_carry_probabilities(whisper_server: RemoteServer) -> None:
    client = whisper_server.openai()
    verbose = client.audio.transcriptions.create(
        model=MODEL,
        file=("short.flac", SHORT.read_bytes()),
        language="en",
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    words = verbose.words
    assert [w.word for w in words] == [
        "A",
        "man",
        "said",
        "to",
        "the",
        "universe,",
        "Sir,",
        "I",
        "exist.",
    ]
    for w in words:
        probability = w.model_extra["probability"] if w.model_extra else w.probability
        assert 0.0 < probability <= 1.0
    times = [t for w in words for t in (w.start, w.end)]
    assert times == sorted(times) and times[-1] <= verbose.duration


def test_vad_filter_prefix_and_suppress_tokens_fields(whisper_server: RemoteServer) -> None:
    client = whisper_server.openai()
    verbose = client.audio.transcriptions.create(
        model=MODEL,
        file=("padded.flac", _padded_flac()),
        language="en",
        response_format="verbose_json",
        timestamp_granularities=["segment"],
        extra_body={"vad_filter": "true", "vad_parameters": '{"min_silence_duration_ms": 500}'},
    )
    assert "universe" in verbose.text
    assert verbose.segments[0].start >= 5.5  # the leading silence was skipped, clock kept
    prefixed = client.audio.transcriptions.create(
        model=MODEL,
        file=("short.flac", SHORT.read_bytes()),
        language="en",
        extra_body={"prefix": "A woman said"},
    )
    assert prefixed.text.strip().startswith("A woman said")
    suppressed = client.audio.transcriptions.create(
        model=MODEL,
        file=("short.flac", SHORT.read_bytes()),
        language="en",
        extra_body={"suppress_tokens": "-1,6445", "no_repeat_ngram_size": 3},  # " universe"
    )
    assert "universe" not in suppressed.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"vad_parameters": "{not json"}, "vad_parameters"),
        ({"vad_parameters": '{"treshold": 0.2}'}, "vad_parameters"),
        ({"suppress_tokens": "a,b"}, "suppress_tokens"),
        ({"max_initial_timestamp": "5"}, "max_initial_timestamp"),
        ({"repetition_penalty": "0"}, "repetition_penalty"),
        ({"hallucination_silence_threshold": "2"}, "hallucination_silence_threshold"),
    ],
)
def test_malformed_option_fields_are_400(
    whisper_server: RemoteServer, fields: dict[str, str], param: str
) -> None:
    with whisper_server.http() as http:
        response = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("short.flac", SHORT.read_bytes())},
            data={"model": MODEL, **fields},
        )
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]
