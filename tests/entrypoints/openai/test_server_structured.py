"""`response_format` (JSON object / JSON schema) and `logit_bias` through `v1 serve` and the
official openai client: every answer parses and validates, plain and streamed, greedy and
sampled; bad schemas are 400s naming response_format (see test_server_bad_inputs.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.conftest import RemoteServer

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
"""Every valid document is short, so max_tokens=120 always reaches EOS."""
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(llama_server: RemoteServer) -> openai.OpenAI:
    return llama_server.openai()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema(client: openai.OpenAI, temperature: float) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=120,
        temperature=temperature,
        n=2,
        response_format=RESPONSE_FORMAT,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=120,
        temperature=0.0,
        stream=True,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_logit_bias(client: openai.OpenAI, llama_server: RemoteServer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model)
    close = tokenizer.convert_tokens_to_ids("}")
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=1.0,
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
    )
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) == {}
    # logit_bias alone: +100 on one token makes it every token (completions take it too).
    biased = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=5,
        temperature=0.0,
        logit_bias={"7": 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text == tokenizer.decode([7] * 5)
    # Text mode is plain generation.
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, response_format={"type": "text"}
    )
    assert plain.choices[0].finish_reason in ("stop", "length")
