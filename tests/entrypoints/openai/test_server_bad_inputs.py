"""Bad requests against every server: each gets its documented 4xx and the OpenAI error body,
the server stays healthy, and afterwards /metrics shows no running request and no KV block in
use. Nothing here reaches a model step, so the whole table runs in seconds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.entrypoints.openai.conftest import AUDIO_DIR, RemoteServer, ServerPool, assert_error_body

ALL_SERVERS = ("llama_server", "whisper_server", "minilm_server", "scorer_server")
pytestmark = [pytest.mark.timeout(300), pytest.mark.uses_servers(*ALL_SERVERS)]

LLAMA, WHISPER, MINILM, SCORER = ALL_SERVERS


def _audio(name: str) -> bytes:
    path = AUDIO_DIR / name
    return path.read_bytes() if path.exists() else b""


FLAC = _audio("jfk.flac")
WAV = _audio("stereo_diarization.wav")


@dataclass(frozen=True)
class Case:
    id: str
    server: str
    path: str
    request: dict[str, Any]
    status: int
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    message_has: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def js(**body: Any) -> dict[str, Any]:
    return {"json": body}


def raw(content: bytes, content_type: str = "application/json") -> dict[str, Any]:
    return {"content": content, "headers": {"Content-Type": content_type}}


def form(file: bytes | None, filename: str = "a.flac", **fields: Any) -> dict[str, Any]:
    files = {"file": (filename, file, "application/octet-stream")} if file is not None else None
    return {"files": files, "data": {"model": "whisper-1", **fields}}


MSG = [{"role": "user", "content": "hi"}]
CMPL, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
TRANSCRIBE, TRANSLATE = "/v1/audio/transcriptions", "/v1/audio/translations"

CASES = [
    # ---- request bodies (tiny Llama) ----
    Case("malformed-json", LLAMA, CMPL, raw(b'{"prompt": "hi",'), 400, message_has="JSON"),
    Case("json-array-body", LLAMA, CMPL, raw(b"[1, 2, 3]"), 400, message_has="JSON object"),
    Case("json-string-body", LLAMA, CMPL, raw(b'"hello"'), 400, message_has="JSON object"),
    Case("empty-body", LLAMA, CMPL, raw(b""), 400),
    Case("not-json-content-type", LLAMA, CMPL, raw(b'{"prompt": "hi"}', "text/plain"), 400),
    Case("body-too-large", LLAMA, CMPL, js(prompt="x" * 1_200_000), 413),
    Case("missing-prompt", LLAMA, CMPL, js(max_tokens=3), 400, param="prompt"),
    Case("empty-prompt", LLAMA, CMPL, js(prompt=""), 400, param="prompt"),
    Case("empty-prompt-list", LLAMA, CMPL, js(prompt=[]), 400, param="prompt"),
    Case("prompt-wrong-type", LLAMA, CMPL, js(prompt=5), 400, param="prompt"),
    Case(
        "huge-max-tokens",
        LLAMA,
        CMPL,
        js(prompt="hi", max_tokens=10**9),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    ),
    Case("zero-max-tokens", LLAMA, CMPL, js(prompt="hi", max_tokens=0), 400, param="max_tokens"),
    Case(
        "nan-temperature",
        LLAMA,
        CMPL,
        raw(b'{"prompt": "hi", "temperature": NaN}'),
        400,
        param="temperature",
    ),
    Case("infinite-top-p", LLAMA, CMPL, raw(b'{"prompt": "hi", "top_p": Infinity}'), 400),
    Case("negative-temperature", LLAMA, CMPL, js(prompt="hi", temperature=-1), 400),
    Case("n-too-large", LLAMA, CMPL, js(prompt="hi", n=1000), 400, param="n"),
    Case("too-many-choices", LLAMA, CMPL, js(prompt=["a"] * 100, n=100), 400, param="n"),
    Case(
        "out-of-vocab-ids",
        LLAMA,
        CMPL,
        js(prompt=[1, 10**6]),
        400,
        param="prompt",
        code="invalid_token_id",
    ),
    Case("negative-token-id", LLAMA, CMPL, js(prompt=[1, -5]), 400, param="prompt"),
    Case(
        "prompt-longer-than-context",
        LLAMA,
        CMPL,
        js(prompt=[5] * 300),
        400,
        code="context_length_exceeded",
    ),
    Case("empty-stop-string", LLAMA, CMPL, js(prompt="hi", stop=[""]), 400, param="stop"),
    Case("logit-bias", LLAMA, CMPL, js(prompt="hi", logit_bias={"5": 1}), 400, "logit_bias"),
    Case("min-over-max-tokens", LLAMA, CMPL, js(prompt="hi", min_tokens=9, max_tokens=2), 400),
    Case("stop-id-out-of-vocab", LLAMA, CMPL, js(prompt="hi", stop_token_ids=[10**7]), 400),
    Case("echo-with-logprobs", LLAMA, CMPL, js(prompt="hi", echo=True, logprobs=1), 400, "echo"),
    Case(
        "unknown-model",
        LLAMA,
        CMPL,
        js(model="gpt-9", prompt="hi"),
        404,
        "model",
        code="model_not_found",
    ),
    Case("chat-no-messages", LLAMA, CHAT, js(messages=[]), 400, param="messages"),
    Case("chat-bad-role", LLAMA, CHAT, js(messages=[{"role": "wizard", "content": "x"}]), 400),
    Case(
        "chat-image-part",
        LLAMA,
        CHAT,
        js(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        message_has="not supported",
    ),
    Case("chat-tools", LLAMA, CHAT, js(messages=MSG, tools=[{"type": "function"}]), 400, "tools"),
    Case("chat-top-logprobs-alone", LLAMA, CHAT, js(messages=MSG, top_logprobs=2), 400),
    Case("embeddings-on-generator", LLAMA, EMB, js(input="hi"), 400, "model", "wrong_model_kind"),
    Case(
        "rerank-on-generator",
        LLAMA,
        "/v1/rerank",
        js(query="q", documents=["d"]),
        400,
        code="wrong_model_kind",
    ),
    Case(
        "transcribe-on-generator",
        LLAMA,
        TRANSCRIBE,
        form(WAV, "a.wav", model="tiny-llama"),
        400,
        code="wrong_model_kind",
    ),
    Case("unknown-route", LLAMA, "/v1/nothing-here", js(), 404),
    Case("get-on-post-route", LLAMA, CMPL, {}, 405, method="GET"),
    # ---- audio (whisper-base) ----
    Case("missing-file", WHISPER, TRANSCRIBE, form(None), 400, param="file"),
    Case("file-as-text-field", WHISPER, TRANSCRIBE, {"data": {"file": "abc"}}, 400, "file"),
    Case(
        "not-audio",
        WHISPER,
        TRANSCRIBE,
        form(b"this is not audio " * 40, "a.mp3"),
        400,
        param="file",
        code="invalid_audio",
    ),
    Case(
        "truncated-flac",
        WHISPER,
        TRANSCRIBE,
        form(FLAC[:100_000]),
        400,
        "file",
        message_has="truncated",
    ),
    Case(
        "truncated-wav",
        WHISPER,
        TRANSLATE,
        form(WAV[: len(WAV) // 2], "a.wav"),
        400,
        "file",
        message_has="truncated",
    ),
    Case("empty-file", WHISPER, TRANSCRIBE, form(b""), 400, param="file"),
    Case(
        "unsupported-format",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, response_format="xml"),
        400,
        param="response_format",
    ),
    Case(
        "invalid-language",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, language="klingon"),
        400,
        param="language",
    ),
    Case(
        "word-timestamps",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, response_format="verbose_json", **{"timestamp_granularities[]": "word"}),
        400,
        param="timestamp_granularities",
    ),
    Case(
        "granularity-needs-verbose",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, **{"timestamp_granularities[]": "segment"}),
        400,
        param="timestamp_granularities",
    ),
    Case(
        "temperature-out-of-range",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, temperature="5"),
        400,
        param="temperature",
    ),
    Case("temperature-nan", WHISPER, TRANSCRIBE, form(FLAC, temperature="nan"), 400),
    Case(
        "stream-srt",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, response_format="srt", stream="true"),
        400,
        param="stream",
    ),
    Case(
        "audio-unknown-model",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, model="whisper-9"),
        404,
        param="model",
    ),
    Case("completions-on-whisper", WHISPER, CMPL, js(prompt="hi"), 400, code="wrong_model_kind"),
    Case("embeddings-on-whisper", WHISPER, EMB, js(input="hi"), 400, code="wrong_model_kind"),
    # ---- pooling (MiniLM, cross-encoder) ----
    Case(
        "dimensions-not-matryoshka",
        MINILM,
        EMB,
        js(input="hi", dimensions=8),
        400,
        param="dimensions",
    ),
    Case("empty-input-list", MINILM, EMB, js(input=[]), 400, param="input"),
    Case("empty-input-string", MINILM, EMB, js(input=["ok", ""]), 400, param="input"),
    Case("input-out-of-vocab", MINILM, EMB, js(input=[[101, 10**7]]), 400, param="input"),
    Case(
        "input-too-long", MINILM, EMB, js(input="word " * 300), 400, code="context_length_exceeded"
    ),
    Case(
        "bad-encoding-format",
        MINILM,
        EMB,
        js(input="hi", encoding_format="int8"),
        400,
        param="encoding_format",
    ),
    Case("chat-on-embedder", MINILM, CHAT, js(messages=MSG), 400, code="wrong_model_kind"),
    Case(
        "rerank-no-documents",
        SCORER,
        "/v1/rerank",
        js(query="q", documents=[]),
        400,
        param="documents",
    ),
    Case(
        "rerank-top-n-zero",
        SCORER,
        "/v1/rerank",
        js(query="q", documents=["d"], top_n=0),
        400,
        param="top_n",
    ),
    Case(
        "score-length-mismatch",
        SCORER,
        "/v1/score",
        js(text_1=["a", "b"], text_2=["c", "d", "e"]),
        400,
        param="text_2",
    ),
    Case("completions-on-scorer", SCORER, CMPL, js(prompt="hi"), 400, code="wrong_model_kind"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(case: Case, server_pool: ServerPool) -> None:
    server = server_pool.get(case.server)
    start = time.monotonic()
    with server.http(timeout=60) as http:
        response = http.request(case.method, case.path, **case.request)
        health = http.get("/health")
    error = assert_error_body(response, case.status)
    assert time.monotonic() - start < 10
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    assert case.message_has in error["message"], error
    assert health.status_code == 200


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_servers_idle_afterwards(name: str, server_pool: ServerPool) -> None:
    server: RemoteServer = server_pool.get(name)
    metrics = server.metrics()
    running = [v for k, v in metrics.items() if k.startswith("v1_num_requests_running")]
    used = [v for k, v in metrics.items() if k.startswith("v1_kv_cache_used_blocks")]
    assert running == [0.0] and used == [0.0]
    assert metrics["v1_http_requests_in_flight"] == 0
    assert metrics["v1_engine_healthy"] == 1
    errors_4xx = sum(
        v for k, v in metrics.items() if k.startswith("v1_http_request_errors_total") and '"4' in k
    )
    assert errors_4xx >= sum(1 for c in CASES if c.server == name)
