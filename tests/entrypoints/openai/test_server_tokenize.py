"""/tokenize, /detokenize, the unprefixed /rerank and /score aliases and HEAD /health, on the
session's tiny Llama and cross-encoder servers."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.openai.conftest import RemoteServer, assert_error_body

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "hello there"}]


def test_tokenize_and_detokenize(llama_server: RemoteServer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_server.model)
    text = "The quick brown fox, naïve café."
    with llama_server.http(timeout=60) as http:
        out = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        chat = http.post("/tokenize", json={"model": "tiny-llama", "messages": MESSAGES}).json()
        back = http.post("/detokenize", json={"tokens": bare["tokens"]}).json()
        completion = http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
        ).json()
        bad_id = http.post("/detokenize", json={"tokens": [1, 10**7]})
        both = http.post("/tokenize", json={"prompt": "a", "messages": MESSAGES})
        unknown_model = http.post("/tokenize", json={"model": "gpt-9", "prompt": "a"})
    assert out["tokens"] == tokenizer(text)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] is None
    assert back == {"prompt": text}
    # The chat template renders exactly what chat completions feed the model.
    assert chat["count"] == completion["usage"]["prompt_tokens"]
    assert assert_error_body(bad_id, 400)["param"] == "tokens"
    assert_error_body(both, 400)
    assert assert_error_body(unknown_model, 404)["param"] == "model"


def test_tokenize_needs_the_api_key(llama_server: RemoteServer) -> None:
    response = httpx.post(llama_server.url + "/tokenize", json={"prompt": "a"})
    assert assert_error_body(response, 401)["code"] == "invalid_api_key"


def test_unprefixed_rerank_and_score(scorer_server: RemoteServer) -> None:
    rerank = {"query": "what is a fox", "documents": ["a fox is an animal", "bread"]}
    score = {"text_1": "what is a fox", "text_2": ["a fox is an animal", "bread"]}
    with scorer_server.http(timeout=60) as http:
        results = [http.post(path, json=rerank).json() for path in ("/v1/rerank", "/rerank")]
        scores = [http.post(path, json=score).json() for path in ("/v1/score", "/score")]
        head = http.head("/health")
    assert results[0]["results"] == results[1]["results"]
    assert [d["score"] for d in scores[0]["data"]] == [d["score"] for d in scores[1]["data"]]
    assert head.status_code == 200 and head.content == b""
