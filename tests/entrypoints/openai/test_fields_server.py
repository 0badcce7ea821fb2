"""No request field is silently ignored, and vLLM's extension fields work (the app over
AsyncLLMs, in this process).

1. An unknown field is OpenAI's 400 "Unrecognized request argument supplied: X" (`param` X, the
   OpenAI error body) on every route: completions, chat (also inside a message), embeddings,
   score, rerank, tokenize, detokenize and the audio forms, whose known fields are the form
   parameters the route declares.
2. Every field of OpenAI's own request types (the installed `openai` package's TypedDicts) is
   either honoured (200) or refused with a 400 that names it and says "not supported"; a field
   of a newer `openai` package that this file does not classify fails the test.
3. vLLM's guided_choice / guided_regex / guided_json / guided_grammar / structured_outputs
   constrain the output (also through the official client's extra_body); prompt_logprobs comes
   back in the choice (vLLM's shape) equal to transformers' for max_tokens=1; priority reaches
   the engine under --scheduling-policy priority and is a 400 under fcfs.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.entrypoints.openai.conftest import CHAT_TEMPLATE, MINILM_DIR, make_chat_llama_dir
from tests.utils import make_tiny_whisper_dir, require_asset

pytestmark = pytest.mark.timeout(300)

SR = 16000
MSG = [{"role": "user", "content": "Hi"}]


# ---- apps ----


def _app(model: str, **engine_args: Any) -> tuple[Any, Any]:
    from v1.engine.async_llm import AsyncLLM
    from v1.entrypoints.openai.api_server import build_app
    from v1.entrypoints.openai.serving_engine import ServerSettings

    llm = AsyncLLM(model, device="cpu", **engine_args)
    settings = ServerSettings(served_model_names=("m",), model_path=model)
    return llm, build_app(llm, settings)


@pytest.fixture(scope="module")
def llama_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = make_chat_llama_dir(tmp_path_factory.mktemp("llama"), CHAT_TEMPLATE)
    llm, app = _app(path, num_kv_blocks=128, policy="priority")
    try:
        yield app
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def minilm_app() -> Iterator[Any]:
    llm, app = _app(str(require_asset(MINILM_DIR)))
    try:
        yield app
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def whisper_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A tiny random Whisper whose decoder says EOS wherever Whisper's rules allow it."""
    from transformers import WhisperForConditionalGeneration

    path = make_tiny_whisper_dir(tmp_path_factory.mktemp("whisper"))
    model = WhisperForConditionalGeneration.from_pretrained(path)
    eos = model.generation_config.eos_token_id
    decoder = model.model.decoder
    direction = torch.randn(decoder.config.d_model, generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    with torch.no_grad():
        decoder.embed_tokens.weight[eos] = 20 * direction
        decoder.layer_norm.weight.zero_()
        decoder.layer_norm.bias.copy_(5 * direction)
    model.save_pretrained(path)
    llm, app = _app(path)
    try:
        yield app
    finally:
        llm.shutdown()


def _flac() -> bytes:
    samples = (0.1 * np.random.default_rng(0).standard_normal(SR)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, SR, format="FLAC")
    return buf.getvalue()


def _post_all(app: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """POSTs each (path, httpx kwargs) to the app, in order."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return [await c.post(path, **kwargs) for path, kwargs in calls]

    return asyncio.run(run())


def _assert_unrecognized(response: httpx.Response, name: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"Unrecognized request argument supplied: {name}"
    assert error["param"] == name
    assert error["type"] == "invalid_request_error"


# ---- 1. unknown fields ----

JSON_ROUTES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 1},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/v1/rerank": {"query": "a", "documents": ["b"]},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}


def test_unknown_fields_are_400_on_every_route(llama_app: Any) -> None:
    calls = [(p, {"json": {**body, "bogus_field": 1}}) for p, body in JSON_ROUTES.items()]
    calls += [
        ("/v1/chat/completions", {"json": {"messages": [{**MSG[0], "bogus": 1}]}}),
        ("/v1/completions", {"json": {"prompt": "Hi", "stream": True, "stream_options": {"x": 1}}}),
        ("/v1/completions", {"json": {"prompt": "Hi", "a_field": 1, "b_field": 2}}),
        ("/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 1}}),  # no unknown field
    ]
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        # Checked before the model kind or the upload: this app serves a Llama.
        calls.append((path, {"files": {"file": ("a.flac", b"x")}, "data": {"bogus_field": "1"}}))
    responses = _post_all(llama_app, calls)
    for response in responses[: len(JSON_ROUTES)]:
        _assert_unrecognized(response, "bogus_field")
    _assert_unrecognized(responses[len(JSON_ROUTES)], "messages.0.bogus")
    _assert_unrecognized(responses[len(JSON_ROUTES) + 1], "stream_options.x")
    both = responses[len(JSON_ROUTES) + 2]
    assert both.status_code == 400
    assert both.json()["error"]["message"] == (
        "Unrecognized request arguments supplied: a_field, b_field"
    )
    assert responses[len(JSON_ROUTES) + 3].status_code == 200
    for response in responses[len(JSON_ROUTES) + 4 :]:
        _assert_unrecognized(response, "bogus_field")


def test_form_fields_known_from_the_route(llama_app: Any) -> None:
    """The audio routes' known set is what their endpoint declares: a declared field passes
    the check (then the Llama app refuses the model kind), an undeclared one does not."""
    from v1.entrypoints.openai.form_fields import REFUSED_AUDIO_FIELDS, body_params

    route = next(
        r for r in llama_app.routes if getattr(r, "path", "") == "/v1/audio/transcriptions"
    )
    declared = {p.alias.split("[")[0] for p in body_params(route.dependant)}
    # beam_size comes through the shared decoding_form dependency, the rest from the route.
    assert {"file", "model", "language", "prompt", "beam_size", "include"} <= declared
    assert not declared & set(REFUSED_AUDIO_FIELDS)
    file = {"file": ("a.flac", b"x")}
    responses = _post_all(
        llama_app,
        [
            ("/v1/audio/transcriptions", {"files": file, "data": {"beam_size": "2"}}),
            ("/v1/audio/transcriptions", {"files": file, "data": {"not_declared": "2"}}),
            ("/v1/audio/transcriptions", {"files": file, "data": {"chunking_strategy[type]": "x"}}),
        ],
    )
    assert responses[0].json()["error"]["code"] == "wrong_model_kind"
    _assert_unrecognized(responses[1], "not_declared")
    assert responses[2].status_code == 400
    assert responses[2].json()["error"]["param"] == "chunking_strategy"


# ---- 2. every OpenAI field: honoured or refused ----


def _spec_keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__) | set(typed_dict.__optional_keys__)


CHAT_FIELDS: dict[str, tuple[bool, dict[str, Any]]] = {
    # field: (honoured, the request's extra fields)
    "audio": (False, {"audio": {"voice": "alloy", "format": "wav"}}),
    "frequency_penalty": (True, {"frequency_penalty": 0.5}),
    "function_call": (False, {"function_call": "auto"}),
    "functions": (False, {"functions": [{"name": "f", "parameters": {}}]}),
    "logit_bias": (True, {"logit_bias": {"5": 1.0}}),
    "logprobs": (True, {"logprobs": True}),
    "max_completion_tokens": (True, {"max_completion_tokens": 2}),
    "max_tokens": (True, {"max_tokens": 2}),
    "messages": (True, {}),
    "metadata": (False, {"metadata": {"k": "v"}}),
    "modalities": (False, {"modalities": ["text", "audio"]}),
    "model": (True, {"model": "m"}),
    "moderation": (False, {"moderation": {"model": "omni-moderation-latest"}}),
    "n": (True, {"n": 2}),
    "parallel_tool_calls": (False, {"parallel_tool_calls": True}),
    "prediction": (False, {"prediction": {"type": "content", "content": "x"}}),
    "presence_penalty": (True, {"presence_penalty": 0.5}),
    "prompt_cache_key": (True, {"prompt_cache_key": "k"}),  # no effect: caching is automatic
    "prompt_cache_options": (False, {"prompt_cache_options": {"ttl": "24h"}}),
    "prompt_cache_retention": (False, {"prompt_cache_retention": "24h"}),
    "reasoning_effort": (False, {"reasoning_effort": "low"}),
    "response_format": (True, {"response_format": {"type": "json_object"}}),
    "safety_identifier": (True, {"safety_identifier": "u1"}),  # no effect: no per-user state
    "seed": (True, {"seed": 3, "temperature": 1.0}),
    "service_tier": (False, {"service_tier": "flex"}),
    "stop": (True, {"stop": ["\n"]}),
    "store": (False, {"store": True}),
    "stream": (True, {"stream": True}),
    "stream_options": (True, {"stream": True, "stream_options": {"include_usage": True}}),
    "temperature": (True, {"temperature": 0.5}),
    "tool_choice": (False, {"tool_choice": "required"}),
    "tools": (False, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    "top_logprobs": (True, {"logprobs": True, "top_logprobs": 2}),
    "top_p": (True, {"top_p": 0.9}),
    "user": (True, {"user": "u1"}),  # no effect: no per-user state
    "verbosity": (False, {"verbosity": "low"}),
    "web_search_options": (False, {"web_search_options": {}}),
}
COMPLETION_FIELDS: dict[str, tuple[bool, dict[str, Any]]] = {
    "best_of": (True, {"best_of": 2}),
    "echo": (True, {"echo": True}),
    "frequency_penalty": (True, {"frequency_penalty": 0.5}),
    "logit_bias": (True, {"logit_bias": {"5": 1.0}}),
    "logprobs": (True, {"logprobs": 2}),
    "max_tokens": (True, {"max_tokens": 2}),
    "model": (True, {"model": "m"}),
    "n": (True, {"n": 2}),
    "presence_penalty": (True, {"presence_penalty": 0.5}),
    "prompt": (True, {}),
    "seed": (True, {"seed": 3, "temperature": 1.0}),
    "stop": (True, {"stop": ["\n"]}),
    "stream": (True, {"stream": True}),
    "stream_options": (True, {"stream": True, "stream_options": {"include_usage": True}}),
    "suffix": (False, {"suffix": " the end"}),
    "temperature": (True, {"temperature": 0.5}),
    "top_p": (True, {"top_p": 0.9}),
    "user": (True, {"user": "u1"}),
}
EMBEDDING_FIELDS: dict[str, tuple[bool, dict[str, Any]]] = {
    "dimensions": (True, {"dimensions": 384}),  # its native size (no Matryoshka: others 400)
    "encoding_format": (True, {"encoding_format": "base64"}),
    "input": (True, {}),
    "model": (True, {"model": "m"}),
    "user": (True, {"user": "u1"}),
}
TRANSCRIPTION_FIELDS: dict[str, tuple[bool, dict[str, Any]]] = {
    "chunking_strategy": (False, {"chunking_strategy": "server_vad"}),
    "file": (True, {}),
    "include": (False, {"include[]": "logprobs"}),
    "keywords": (False, {"keywords[]": "hello"}),
    "known_speaker_names": (False, {"known_speaker_names[]": "agent"}),
    "known_speaker_references": (
        False,
        {"known_speaker_references[]": "data:audio/wav;base64,AAAA"},
    ),
    "language": (True, {"language": "en"}),
    "languages": (False, {"languages[]": "en"}),
    "model": (True, {"model": "m"}),
    "prompt": (True, {"prompt": "hello"}),
    "response_format": (True, {"response_format": "text"}),
    "stream": (True, {"stream": "true"}),
    "temperature": (True, {"temperature": "0.2"}),
    "timestamp_granularities": (
        True,
        {"timestamp_granularities[]": "segment", "response_format": "verbose_json"},
    ),
}
TRANSLATION_FIELDS: dict[str, tuple[bool, dict[str, Any]]] = {
    "file": (True, {}),
    "model": (True, {"model": "m"}),
    "prompt": (True, {"prompt": "hello"}),
    "response_format": (True, {"response_format": "text"}),
    "temperature": (True, {"temperature": "0.2"}),
}


def _check_spec(
    app: Any,
    path: str,
    keys: set[str],
    table: dict[str, tuple[bool, dict[str, Any]]],
    make: Any,
) -> None:
    assert keys == set(table), f"classify the new OpenAI fields: {sorted(keys ^ set(table))}"
    names = sorted(table)
    responses = _post_all(app, [(path, make(table[name][1])) for name in names])
    for name, response in zip(names, responses, strict=True):
        honoured = table[name][0]
        if honoured:
            assert response.status_code == 200, (name, response.text)
        else:
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert "not supported" in error["message"], (name, error)
            assert error["param"] == name, (name, error)


def test_openai_completion_and_chat_fields(llama_app: Any) -> None:
    from openai.types import completion_create_params as cmpl
    from openai.types.chat import completion_create_params as chat

    _check_spec(
        llama_app,
        "/v1/chat/completions",
        _spec_keys(chat.CompletionCreateParamsStreaming),
        CHAT_FIELDS,
        lambda extra: {"json": {"messages": MSG, "max_tokens": 2, **extra}},
    )
    _check_spec(
        llama_app,
        "/v1/completions",
        _spec_keys(cmpl.CompletionCreateParamsStreaming),
        COMPLETION_FIELDS,
        lambda extra: {"json": {"prompt": "Hi", "max_tokens": 2, **extra}},
    )


def test_openai_embedding_fields(minilm_app: Any) -> None:
    from openai.types import embedding_create_params as emb

    _check_spec(
        minilm_app,
        "/v1/embeddings",
        _spec_keys(emb.EmbeddingCreateParams),
        EMBEDDING_FIELDS,
        lambda extra: {"json": {"input": "Hi", **extra}},
    )


@pytest.mark.slow
def test_openai_audio_fields(whisper_app: Any) -> None:
    from openai.types.audio import transcription_create_params as tr
    from openai.types.audio import translation_create_params as tl

    flac = _flac()

    def make(extra: dict[str, Any]) -> dict[str, Any]:
        return {"files": {"file": ("a.flac", flac)}, "data": extra}

    _check_spec(
        whisper_app,
        "/v1/audio/transcriptions",
        _spec_keys(tr.TranscriptionCreateParamsStreaming),
        TRANSCRIPTION_FIELDS,
        make,
    )
    _check_spec(
        whisper_app,
        "/v1/audio/translations",
        _spec_keys(tl.TranslationCreateParams),
        TRANSLATION_FIELDS,
        make,
    )


def test_stream_options_needs_stream(llama_app: Any) -> None:
    (response,) = _post_all(
        llama_app,
        [
            (
                "/v1/completions",
                {"json": {"prompt": "Hi", "stream_options": {"include_usage": True}}},
            )
        ],
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


# ---- 3. vLLM's extension fields ----

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}


def test_guided_fields_constrain_the_output(llama_app: Any) -> None:
    import json
    import re

    import jsonschema

    def cmpl(**extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {
            "json": {"prompt": "Hi", "max_tokens": 30, "n": 3, "temperature": 1.0, **extra}
        }

    checks = [
        (cmpl(guided_choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (cmpl(guided_regex="[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        (cmpl(guided_json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (
            cmpl(guided_json=json.dumps(SCHEMA)),
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (
            cmpl(guided_grammar='start: "x" /[0-9]{1,3}/ ";"'),
            lambda t: re.fullmatch("x[0-9]{1,3};", t),
        ),
        (
            cmpl(guided_grammar='root ::= "<" [ab]{1,4} ">"'),
            lambda t: re.fullmatch("<[ab]{1,4}>", t),
        ),
        (cmpl(structured_outputs={"choice": ["a b", "c"]}), lambda t: t in ("a b", "c")),
        (cmpl(structured_outputs={"regex": "[A-Z]{2}"}), lambda t: re.fullmatch("[A-Z]{2}", t)),
        (
            cmpl(structured_outputs={"json": SCHEMA}),
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (
            cmpl(structured_outputs={"grammar": 'start: "ok" | "ko"'}),
            lambda t: t in ("ok", "ko"),
        ),
        (
            (
                "/v1/chat/completions",
                {
                    "json": {
                        "messages": MSG,
                        "max_tokens": 30,
                        "n": 2,
                        "guided_choice": ["up", "down"],
                    }
                },
            ),
            lambda t: t in ("up", "down"),
        ),
    ]
    responses = _post_all(llama_app, [call for call, _ in checks])
    for (call, check), response in zip(checks, responses, strict=True):
        assert response.status_code == 200, (call, response.text)
        for choice in response.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop", (call, text)
            assert check(text), (call, text)


def test_guided_fields_refused_clearly(llama_app: Any) -> None:
    def cmpl(**extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 4, **extra}}

    cases = [
        (cmpl(guided_choice=["a"], guided_regex="a"), "guided_choice"),
        (cmpl(guided_regex="(["), "guided_regex"),
        (cmpl(guided_grammar="start: nowhere"), "guided_grammar"),
        (cmpl(guided_choice=[]), "guided_choice"),
        (cmpl(structured_outputs={"whitespace_pattern": " "}), "structured_outputs"),
        (cmpl(structured_outputs={}), "structured_outputs"),
        (cmpl(guided_choice=["a"], use_beam_search=True, best_of=2), "guided_choice"),
        (cmpl(response_format={"type": "json_object"}, use_beam_search=True), "response_format"),
        (cmpl(prompt_logprobs=1, use_beam_search=True), "prompt_logprobs"),
        (cmpl(prompt_logprobs=21), "prompt_logprobs"),
    ]
    responses = _post_all(llama_app, [call for call, _ in cases])
    for (call, param), response in zip(cases, responses, strict=True):
        assert response.status_code == 400, (call, response.text)
        assert response.json()["error"]["param"] == param, (call, response.text)


def test_openai_client_extra_body(llama_app: Any) -> None:
    """The official client sends vLLM's fields through extra_body."""
    import openai

    async def run() -> Any:
        transport = httpx.ASGITransport(app=llama_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = openai.AsyncOpenAI(
                base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
            )
            chat = await client.chat.completions.create(
                model="m",
                messages=MSG,
                max_tokens=10,
                extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
            )
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(
                    model="m", prompt="Hi", extra_body={"guided_choise": ["x"]}
                )
            return chat, bad.value

    chat, bad = asyncio.run(run())
    assert chat.choices[0].message.content in ("red", "blue")
    assert bad.status_code == 400
    assert bad.body["message"] == "Unrecognized request argument supplied: guided_choise"


def test_prompt_logprobs_served(llama_app: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = llama_app.state.engine
    path = engine.model_config.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox jumps"
    ids = tokenizer(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    body = {"prompt": text, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    plain, streamed, echoed, chat = _post_all(
        llama_app,
        [
            ("/v1/completions", {"json": body}),
            ("/v1/completions", {"json": {**body, "stream": True}}),
            ("/v1/completions", {"json": {**body, "echo": True, "logprobs": 1}}),
            (
                "/v1/chat/completions",
                {"json": {"messages": MSG, "max_tokens": 1, "prompt_logprobs": 0}},
            ),
        ],
    )
    assert plain.status_code == 200, plain.text
    entries = plain.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        entry = entries[position]
        row = expected[position - 1]
        assert entry[str(ids[position])]["logprob"] == pytest.approx(
            row[ids[position]].item(), abs=1e-4
        )
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] is not None)
        ranked = [t for r, t in ranked if r <= 2]
        assert ranked == row.topk(2).indices.tolist()
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == entries
    # echo's logprobs keep their own top-1, prompt_logprobs its top-2.
    choice = echoed.json()["choices"][0]
    assert choice["prompt_logprobs"] == entries
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])
    assert chat.status_code == 200, chat.text
    chat_entries = chat.json()["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])


def test_priority_reaches_the_engine(llama_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    engine = llama_app.state.engine
    seen: list[int] = []
    generate = engine.generate

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("priority", 0))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    ok, chat_ok = _post_all(
        llama_app,
        [
            ("/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 1, "priority": -7}}),
            ("/v1/chat/completions", {"json": {"messages": MSG, "max_tokens": 1, "priority": 5}}),
        ],
    )
    assert ok.status_code == 200 and chat_ok.status_code == 200
    assert seen == [-7, 5]
    fcfs = SimpleNamespace(scheduler_config=SimpleNamespace(policy="fcfs"))
    monkeypatch.setattr(engine, "config", fcfs)
    (refused,) = _post_all(
        llama_app, [("/v1/completions", {"json": {"prompt": "Hi", "priority": 1}})]
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]


def test_scheduling_policy_flag() -> None:
    from v1.entrypoints.cli import engine_kwargs, make_parser

    args = make_parser().parse_args(["serve", "m", "--scheduling-policy", "priority"])
    assert engine_kwargs(args)["policy"] == "priority"
