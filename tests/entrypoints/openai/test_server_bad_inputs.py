"""Bad requests against every server: each gets its documented 4xx and the OpenAI error body,
the server stays healthy, and afterwards /metrics shows no running request and no KV block in
use. Nothing here reaches a model step, so the whole table runs in seconds."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, RemoteServer, ServerPool, assert_error_body

ALL_SERVERS = ("llama_server", "whisper_server", "minilm_server", "scorer_server")
pytestmark = [pytest.mark.timeout(300), pytest.mark.uses_servers(*ALL_SERVERS)]

LLAMA, WHISPER, MINILM, SCORER = ALL_SERVERS


def _audio(name: str) -> bytes:
    path = AUDIO_DIR / name
    return path.read_bytes() if path.exists() else b""


FLAC = _audio("jfk.flac")
WAV = _audio("stereo_diarization.wav")


def silent_flac(seconds: int, sample_rate: int = 16_000) -> bytes:
    """A FLAC of silence (about 50 bytes a second), its length in the header."""
    buf = io.BytesIO()
    block = np.zeros(sample_rate * 60, dtype=np.float32)
    with sf.SoundFile(buf, "w", sample_rate, 1, format="FLAC", subtype="PCM_16") as f:
        for start in range(0, seconds, 60):
            f.write(block[: sample_rate * min(60, seconds - start)])
    return buf.getvalue()


def hide_flac_length(data: bytes) -> bytes:
    """The same FLAC with STREAMINFO's total-samples field zeroed ("unknown length")."""
    out = bytearray(data)
    assert out[:4] == b"fLaC"
    out[8 + 13] &= 0xF0  # STREAMINFO starts at byte 8; total samples: 36 bits from byte 13
    out[8 + 14 : 8 + 18] = b"\0\0\0\0"
    return bytes(out)


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
    Case("body-too-large", LLAMA, CMPL, js(prompt="x" * 12_100_000), 413),
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
    Case(
        "logit-bias-range", LLAMA, CMPL, js(prompt="hi", logit_bias={"5": 101}), 400, "logit_bias"
    ),
    Case("logit-bias-key", LLAMA, CHAT, js(messages=MSG, logit_bias={"x": 1}), 400, "logit_bias"),
    Case(
        "logit-bias-out-of-vocab",
        LLAMA,
        CMPL,
        js(prompt="hi", logit_bias={"1000000": 1}),
        400,
        "logit_bias",
    ),
    Case("min-over-max-tokens", LLAMA, CMPL, js(prompt="hi", min_tokens=9, max_tokens=2), 400),
    Case("stop-id-out-of-vocab", LLAMA, CMPL, js(prompt="hi", stop_token_ids=[10**7]), 400),
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
    Case(
        "file-part-without-filename",
        WHISPER,
        TRANSCRIBE,
        {"files": {"file": (None, FLAC)}, "data": {"model": "whisper-1"}},
        400,
        param="file",
        message_has="filename",
    ),
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
        "word-timestamps-need-verbose",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, response_format="json", **{"timestamp_granularities[]": "word"}),
        400,
        param="timestamp_granularities",
    ),
    Case(
        "unknown-granularity",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, response_format="verbose_json", **{"timestamp_granularities[]": "phoneme"}),
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
    # ---- numbers outside what the engine's tensors hold (issue 14, item 1) ----
    Case("top-k-2-63", LLAMA, CMPL, js(prompt="hi", top_k=2**63), 400, param="top_k"),
    Case("top-k-2-64", LLAMA, CMPL, js(prompt="hi", top_k=2**64), 400, param="top_k"),
    Case(
        "repetition-penalty-1e300",
        LLAMA,
        CMPL,
        js(prompt="hi", repetition_penalty=1e300),
        400,
        param="repetition_penalty",
    ),
    Case("min-tokens-2-40", LLAMA, CMPL, js(prompt="hi", min_tokens=2**40), 400, "min_tokens"),
    Case(
        "stop-id-2-40", LLAMA, CMPL, js(prompt="hi", stop_token_ids=[2**40]), 400, "stop_token_ids"
    ),
    Case("seed-2-64", LLAMA, CMPL, js(prompt="hi", seed=2**64), 400, param="seed"),
    Case("max-tokens-2-63", LLAMA, CHAT, js(messages=MSG, max_tokens=2**63), 400, "max_tokens"),
    # ---- text that is not Unicode (item 6) ----
    Case(
        "lone-surrogate-prompt",
        LLAMA,
        CMPL,
        raw(b'{"prompt": "hi \\ud800 there"}'),
        400,
        param="prompt",
        message_has="surrogate",
    ),
    Case(
        "lone-surrogate-chat",
        LLAMA,
        CHAT,
        raw(b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
        400,
        param="messages",
    ),
    Case(
        "lone-surrogate-stop",
        LLAMA,
        CMPL,
        raw(b'{"prompt": "a", "stop": ["\\ud800"]}'),
        400,
        "stop",
    ),
    Case(
        "lone-surrogate-embedding",
        MINILM,
        EMB,
        raw(b'{"input": ["ok", "\\ud83d"]}'),
        400,
        param="input",
    ),
    # ---- options that would otherwise be silently ignored (item 7) ----
    Case(
        "json-schema-unknown-type",
        LLAMA,
        CHAT,
        js(
            messages=MSG,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        ),
        400,
        param="response_format",
        message_has="nope",
    ),
    Case(
        "json-schema-bad-ref",
        LLAMA,
        CMPL,
        js(
            prompt="hi",
            response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}},
        ),
        400,
        param="response_format",
    ),
    Case(
        "response-format-xml",
        LLAMA,
        CHAT,
        js(messages=MSG, response_format={"type": "xml"}),
        400,
        param="response_format",
    ),
    Case(
        "json-mode-ignore-eos",
        LLAMA,
        CMPL,
        js(prompt="hi", ignore_eos=True, response_format={"type": "json_object"}),
        400,
        param="ignore_eos",
    ),
    Case(
        "json-schema-mode",
        LLAMA,
        CHAT,
        js(messages=MSG, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        param="response_format",
    ),
    Case("tool-choice", LLAMA, CHAT, js(messages=MSG, tool_choice="auto"), 400, "tool_choice"),
    Case("functions", LLAMA, CHAT, js(messages=MSG, functions=[{"name": "f"}]), 400, "functions"),
    Case(
        "function-call",
        LLAMA,
        CHAT,
        js(messages=MSG, function_call={"name": "f"}),
        400,
        param="function_call",
    ),
    Case("audio-modality", LLAMA, CHAT, js(messages=MSG, modalities=["audio"]), 400, "modalities"),
    Case(
        "audio-include-logprobs",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, **{"include[]": "logprobs"}),
        400,
        param="include",
    ),
    Case(
        "audio-vad-chunking",
        WHISPER,
        TRANSCRIBE,
        form(FLAC, chunking_strategy="server_vad"),
        400,
        param="chunking_strategy",
    ),
    # ---- size limits before any work (items 3 and 8) ----
    Case(
        "prompt-over-char-limit",
        LLAMA,
        CMPL,
        js(prompt="hello " * 50_000),
        400,
        param="prompt",
        code="context_length_exceeded",
        message_has="--max-prompt-chars",
    ),
    Case(
        "chat-over-char-limit",
        LLAMA,
        CHAT,
        js(messages=[{"role": "user", "content": "hello " * 50_000}]),
        400,
        param="messages",
        code="context_length_exceeded",
    ),
    Case(
        "tokens-per-request",
        LLAMA,
        CMPL,
        js(prompt=[[5] * 200] * 25, max_tokens=1),  # 5,000 tokens; the server allows 4,096
        400,
        param="prompt",
        code="request_too_large",
    ),
    Case(
        "tokens-per-request-n",
        LLAMA,
        CMPL,
        js(prompt=[5] * 200, n=25, max_tokens=1),
        400,
        param="prompt",
        code="request_too_large",
    ),
    # ---- audio length (item 2) ----
    Case(
        "declared-too-long",
        WHISPER,
        TRANSCRIBE,
        form(silent_flac(1200)),
        400,
        param="file",
        message_has="1200.0 s",
    ),
    Case(
        "hidden-length-too-long",
        WHISPER,
        TRANSCRIBE,
        form(hide_flac_length(silent_flac(1200))),
        400,
        param="file",
        message_has="packets hold",
    ),
]


def _one_second_wav() -> bytes:
    samples, rate = sf.read(io.BytesIO(FLAC), dtype="float32") if FLAC else (np.zeros(0), 16000)
    buf = io.BytesIO()
    sf.write(buf, samples[: int(rate)], rate, format="WAV")
    return buf.getvalue()


NORMAL_REQUESTS = {
    LLAMA: (CMPL, js(prompt="hi", max_tokens=1)),
    WHISPER: (TRANSCRIBE, form(_one_second_wav(), "a.wav")),
    MINILM: (EMB, js(input="hi")),
    SCORER: ("/v1/score", js(text_1="a", text_2="b")),
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(case: Case, server_pool: ServerPool) -> None:
    server = server_pool.get(case.server)
    start = time.monotonic()
    with server.http(timeout=60) as http:
        response = http.request(case.method, case.path, **case.request)
        health = http.get("/health")
        error = assert_error_body(response, case.status)
        assert time.monotonic() - start < 10
        path, normal = NORMAL_REQUESTS[case.server]
        after = http.post(path, **normal)
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    assert case.message_has in error["message"], error
    assert health.status_code == 200
    assert after.status_code == 200, after.text  # the server still serves normal requests


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
    # The normal request after each case finished normally and was counted so.
    finished = sum(v for k, v in metrics.items() if k.startswith("v1_request_finish_total"))
    assert finished >= sum(1 for c in CASES if c.server == name)
    total = [v for k, v in metrics.items() if k.startswith("v1_kv_cache_total_blocks")]
    if name in (LLAMA, WHISPER):
        assert total and total[0] > 0
        lookups = server.metric("v1_encoder_cache_lookups")
        runs = server.metric("v1_encoder_runs")
        assert (lookups > runs > 0) if name == WHISPER else lookups == runs == 0


# ---- one request never harms another ----


def _stream_completion(server: RemoteServer, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, finish, events = "", None, []
    with (
        server.http(timeout=120) as http,
        http.stream("POST", CMPL, json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            events.append(event)
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return {"text": text, "finish": finish}


POISON = [
    {"top_k": 2**63},
    {"top_k": 2**64},
    {"repetition_penalty": 1e300},
    {"min_tokens": 2**40, "max_tokens": 2**40},
    {"stop_token_ids": [2**63]},
    {"presence_penalty": 1e39},
]


@pytest.mark.uses_servers(LLAMA)
def test_poisoned_requests_beside_honest_streams(server_pool: ServerPool) -> None:
    """Hostile numbers sent while four honest streams run: each is a 400 naming its field,
    and the honest streams finish intact (the same text as when run alone)."""
    server = server_pool.get(LLAMA)
    prompts = [f"stream number {i} says" for i in range(4)]
    alone = [_stream_completion(server, p, 24) for p in prompts]
    results: dict[int, Any] = {}
    rejected: list[tuple[dict[str, Any], httpx.Response]] = []

    def honest(i: int) -> None:
        results[i] = _stream_completion(server, prompts[i], 24)

    threads = [threading.Thread(target=honest, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    with server.http(timeout=60) as http:
        for poison in POISON:
            rejected.append((poison, http.post(CMPL, json={"prompt": "x", **poison})))
    for t in threads:
        t.join(timeout=120)
    for poison, response in rejected:
        error = assert_error_body(response, 400)
        assert error["param"] == next(iter(poison)), (poison, error)
    assert [results[i] for i in range(4)] == alone
    assert all(r["finish"] == "length" for r in alone)


@pytest.mark.uses_servers(WHISPER)
def test_hidden_length_flac_is_refused_in_bounded_memory(server_pool: ServerPool) -> None:
    """A 2 h FLAC whose header hides its length, against a 900 s cap: refused without
    decoding (decoding to the cap would hold 900 s x 16 kHz x 4 B = 58 MB of samples)."""
    server = server_pool.get(WHISPER)
    bomb = hide_flac_length(silent_flac(7200))
    assert len(bomb) < 1_000_000
    baseline = _rss_bytes(server.proc.pid)
    peak = {"rss": baseline}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], _rss_bytes(server.proc.pid))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        start = time.monotonic()
        with server.http(timeout=60) as http:
            response = http.post(TRANSCRIBE, **form(bomb))
        elapsed = time.monotonic() - start
    finally:
        done.set()
        watcher.join()
    error = assert_error_body(response, 400)
    assert error["param"] == "file" and "too long" in error["message"]
    assert elapsed < 5
    growth = peak["rss"] - baseline
    assert growth < 24 << 20, f"the server grew by {growth / 2**20:.1f} MiB"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.uses_servers(LLAMA)
def test_health_answers_during_huge_prompts(server_pool: ServerPool) -> None:
    """/health keeps answering while a 10 MB prompt (refused by the character limit) and prompts
    just under the limit (tokenized on the input thread, off the event loop) are in flight: it
    answers between their starts and their ends, so the loop was not held for the whole of
    their work. (No latency bound: a loaded machine may be slow at anything.)"""
    server = server_pool.get(LLAMA)
    outcome: dict[str, Any] = {}

    def huge() -> None:
        with server.http(timeout=300) as http:
            outcome["huge"] = http.post(CMPL, json={"prompt": "x" * 10_000_000})

    def long_ones() -> None:
        with server.http(timeout=300) as http:
            outcome["long"] = [
                http.post(CMPL, json={"prompt": "hello world " * 16_000, "max_tokens": 1})
                for _ in range(3)
            ]

    threads = [threading.Thread(target=huge), threading.Thread(target=long_ones)]
    answered_in_flight = 0
    with server.http(timeout=120) as http:
        http.get("/health")  # connect first
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            assert http.get("/health").status_code == 200
            if any(t.is_alive() for t in threads):
                answered_in_flight += 1
            time.sleep(0.01)
    for t in threads:
        t.join()
    error = assert_error_body(outcome["huge"], 400)
    assert error["param"] == "prompt" and "--max-prompt-chars" in error["message"]
    for response in outcome["long"]:  # 192,000 characters: tokenized, then over the budget
        assert assert_error_body(response, 400)["code"] == "request_too_large"
    assert answered_in_flight >= 1
