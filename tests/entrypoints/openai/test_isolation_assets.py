"""Isolation checks on the servers of the real-weights models: an embeddings request over the
per-request token budget is refused before any work, an audio upload over --max-audio-bytes is
a 413, and transcribed tokens count as generation tokens in /metrics."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import (
    AUDIO_DIR,
    MAX_AUDIO_BYTES,
    RemoteServer,
    assert_error_body,
)

pytestmark = pytest.mark.timeout(300)


def test_embeddings_over_the_token_budget_are_refused(minilm_server: RemoteServer) -> None:
    """400 inputs of 200 token ids (80,000 tokens) pass every per-input check; the request as a
    whole is over the default --max-tokens-per-request (65,536) and runs nothing."""
    body = {"input": [[1000 + i % 500 for i in range(200)]] * 400}
    with minilm_server.http(timeout=120) as http:
        error = assert_error_body(http.post("/v1/embeddings", json=body), 400)
    assert error["code"] == "request_too_large" and "--max-tokens-per-request" in error["message"]


def test_oversized_upload_is_a_413(whisper_server: RemoteServer) -> None:
    """Over --max-audio-bytes but inside the form allowance the middleware grants: the bounded
    upload read stops at the limit."""
    data = b"\0" * (MAX_AUDIO_BYTES + 300_000)
    with whisper_server.http(timeout=120) as http:
        r = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("big.wav", data, "audio/wav")},
            data={"model": "whisper-1"},
        )
    error = assert_error_body(r, 413)
    assert error["param"] == "file" and error["code"] == "payload_too_large"


def test_transcription_tokens_are_counted(whisper_server: RemoteServer) -> None:
    audio = (AUDIO_DIR / "jfk.flac").read_bytes()
    before = whisper_server.metric("v1_generation_tokens_total")
    with whisper_server.http(timeout=300) as http:
        r = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("jfk.flac", audio, "audio/flac")},
            data={"model": "whisper-1"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["text"].strip()
    assert whisper_server.metric("v1_generation_tokens_total") >= before + 10
