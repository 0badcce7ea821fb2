"""`v1 serve` with a tiny random Llama through the official openai client: models, health, API
key, completions and chat (plain and streamed), logprobs, stop strings, n > 1, echo (with prompt
logprobs), and client disconnects aborting the engine's work."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.conftest import API_KEY, RemoteServer, assert_error_body

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
]


@pytest.fixture(scope="module")
def client(llama_server: RemoteServer) -> openai.OpenAI:
    return llama_server.openai()


def greedy(**kwargs: object) -> dict[str, object]:
    return {"temperature": 0.0, "ignore_eos": True, **kwargs}


def test_models_version_and_health(llama_server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama", "tiny-llama-alias"]
    assert models.data[0].max_model_len == 256
    assert client.models.retrieve("tiny-llama-alias").id == "tiny-llama-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with llama_server.http() as http:
        version = http.get("/version")
        assert version.status_code == 200 and version.json()["version"]
    # /health needs no key; everything else does.
    assert httpx.get(llama_server.url + "/health").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}],
    ids=["no-key", "wrong-key", "wrong-scheme"],
)
@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/version"])
def test_api_key_required(llama_server: RemoteServer, headers: dict, path: str) -> None:
    response = httpx.get(llama_server.url + path, headers=headers)
    error = assert_error_body(response, 401)
    assert error["code"] == "invalid_api_key"


def test_openai_client_with_wrong_key(llama_server: RemoteServer) -> None:
    bad = openai.OpenAI(base_url=llama_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_completion_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=7, **_x(greedy()))
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.completion_tokens == 7
    tokenizer_len = out.usage.prompt_tokens
    assert tokenizer_len >= 2 and out.usage.total_tokens == tokenizer_len + 7
    # The alias serves the same model; greedy decoding is deterministic.
    again = client.completions.create(
        model="tiny-llama-alias", prompt="hello world", max_tokens=7, **_x(greedy())
    )
    assert again.choices[0].text == choice.text
    assert again.model == MODEL  # the first served name is the one reported


def test_token_id_prompts_match_text_prompt(
    client: openai.OpenAI, llama_server: RemoteServer
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model)
    ids = tokenizer("the quick brown fox")["input_ids"]
    by_text = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=5, **_x(greedy())
    )
    by_ids = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=5, **_x(greedy())
    )
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_n_echo_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=["hello", "the quick"],
        max_tokens=4,
        n=3,
        temperature=1.0,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 6 * 4
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # sampled + top 2
        assert lp.text_offset == sorted(lp.text_offset)
    echoed = client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=3, echo=True, **_x(greedy())
    )
    assert echoed.choices[0].text.startswith("hello there")


def test_echo_with_logprobs(client: openai.OpenAI, llama_server: RemoteServer) -> None:
    """echo + logprobs: the prompt's tokens come first, the first with no logprob, each later
    one with its logprob and top tokens; then the completion's; offsets run through both."""
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model)
    prompt = "hello there world"
    num_prompt = len(tokenizer(prompt)["input_ids"])
    args = dict(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, **_x(greedy()))
    out = client.completions.create(**args)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # keyed by text: may merge
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = client.completions.create(**(args | {"echo": False}))
    assert lp.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs
    streamed = {"tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed["tokens"] += c.logprobs.tokens
                streamed["token_logprobs"] += c.logprobs.token_logprobs
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs}


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="to be or", max_tokens=24, **_x(greedy()))
    text = full.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {text!r}")
    cut = client.completions.create(
        model=MODEL, prompt="to be or", max_tokens=24, stop=[stop], **_x(greedy())
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_streamed_completion_equals_plain(client: openai.OpenAI) -> None:
    plain = client.completions.create(
        model=MODEL, prompt=["hello world", "all that"], max_tokens=9, **_x(greedy())
    )
    stream = client.completions.create(
        model=MODEL,
        prompt=["hello world", "all that"],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        **_x(greedy()),
    )
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in plain.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 18
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_uses_the_template(client: openai.OpenAI, llama_server: RemoteServer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=6, **_x(greedy())
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 6
    # Same tokens through /v1/completions: the chat endpoint only formats.
    raw = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=6, **_x(greedy()))
    assert out.choices[0].message.content == raw.choices[0].text


def test_chat_stream_and_logprobs(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **_x(greedy())
    )
    content = plain.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, **_x(greedy())
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_raw_sse_framing(llama_server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, **greedy()}
    with llama_server.http(timeout=60) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def _wait_idle(server: RemoteServer, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        running = metrics['v1_num_requests_running{model_name="tiny-llama"}']
        used = metrics['v1_kv_cache_used_blocks{model_name="tiny-llama"}']
        if (running == 0 and used == 0) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_client_disconnect_aborts_the_request(llama_server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 250, **greedy()}
    key = 'v1_http_requests_total{endpoint="/v1/completions",status="499"}'
    aborts = (
        'v1_request_finish_total{endpoint="/v1/completions",model_name="tiny-llama",reason="abort"}'
    )
    before = llama_server.metrics().get(key, 0.0)
    aborts_before = llama_server.metrics().get(aborts, 0.0)
    # n=8 x 250 tokens: far longer than the client waits, on any machine.
    with llama_server.http() as http, pytest.raises(httpx.TimeoutException):
        http.post("/v1/completions", json={**body, "n": 8}, timeout=0.25)
    metrics = _wait_idle(llama_server)
    assert metrics.get(key, 0.0) == before + 1  # seen as a disconnect, not finished
    assert metrics['v1_num_requests_running{model_name="tiny-llama"}'] == 0
    assert metrics['v1_kv_cache_used_blocks{model_name="tiny-llama"}'] == 0
    # Streaming: close the stream after the first event.
    with (
        llama_server.http(timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert next(r.iter_lines()).startswith("data: {")
    start = time.monotonic()
    metrics = _wait_idle(llama_server)
    assert metrics['v1_num_requests_running{model_name="tiny-llama"}'] == 0
    assert metrics['v1_kv_cache_used_blocks{model_name="tiny-llama"}'] == 0
    assert time.monotonic() - start < 5  # aborted, not left to generate 250 tokens
    # Both count as aborts, the stream too (its status was 200 when the client left).
    assert metrics[aborts] == aborts_before + 2


def test_latency_metrics_are_recorded(llama_server: RemoteServer, client: openai.OpenAI) -> None:
    before = llama_server.metrics()
    client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **_x(greedy()))
    after = llama_server.metrics()
    labels = '{endpoint="/v1/completions",model_name="tiny-llama"}'
    ttft = f"v1_time_to_first_token_seconds_count{labels}"
    itl = f"v1_inter_token_latency_seconds_count{labels}"
    e2e = f"v1_e2e_request_latency_seconds_count{labels}"
    length = 'v1_request_finish_total{endpoint="/v1/completions",model_name="tiny-llama",reason="length"}'
    assert after[ttft] == before.get(ttft, 0) + 1
    assert after[itl] >= before.get(itl, 0) + 3
    assert after[e2e] == before.get(e2e, 0) + 1
    assert after[length] == before.get(length, 0) + 1
    ok = 'v1_http_requests_total{endpoint="/v1/completions",status="200"}'
    assert after[ok] == before.get(ok, 0) + 1


def _x(extra: dict[str, object]) -> dict[str, object]:
    """Split vLLM extensions into `extra_body` for the openai client."""
    standard = {k: v for k, v in extra.items() if k in ("temperature",)}
    rest = {k: v for k, v in extra.items() if k not in standard}
    return {**standard, "extra_body": rest} if rest else standard


def test_beam_search_and_best_of(llama_server: RemoteServer, server_pool) -> None:
    """use_beam_search returns transformers' num_beams sequences (best_of beams, the n best);
    best_of > n samples best_of and keeps the n most likely; neither streams."""
    import torch
    from transformers import AutoModelForCausalLM

    client = llama_server.openai()
    model_dir = str(server_pool.root / "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        rows = hf.generate(
            ids, do_sample=False, num_beams=3, num_return_sequences=2, max_new_tokens=6
        ).tolist()
    expected = [tokenizer.decode(r[ids.shape[1] :], skip_special_tokens=True) for r in rows]

    out = client.completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=6,
        n=2,
        best_of=3,
        extra_body={"use_beam_search": True},
    )
    assert [c.text for c in out.choices] == expected
    assert [c.index for c in out.choices] == [0, 1]

    sampled = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=4, n=2, best_of=4, temperature=1.0, seed=3
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    assert all(c.logprobs is None for c in sampled.choices)  # not asked for

    with llama_server.http() as http:
        body = {"model": MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True}
        assert_error_body(http.post("/v1/completions", json=body), 400)
        body = {"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}
        assert_error_body(http.post("/v1/completions", json=body), 400)
