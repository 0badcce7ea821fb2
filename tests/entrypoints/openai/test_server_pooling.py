"""/v1/embeddings with the real all-MiniLM-L6-v2 (float and base64 through the openai client,
token-id inputs, `dimensions` refused on a non-Matryoshka model unless native, bi-encoder /v1/score), and
/v1/rerank + /v1/score with a tiny random BertForSequenceClassification checked against HF."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from tests.entrypoints.openai.conftest import MINILM_DIR, RemoteServer

pytestmark = pytest.mark.timeout(300)

MOVIE = ["The new movie is awesome", "The new movie is so great", "A monkey is playing drums."]


@pytest.fixture(scope="module")
def minilm(minilm_server: RemoteServer) -> openai.OpenAI:
    return minilm_server.openai()


def _cosine(u: list[float], v: list[float]) -> float:
    a, b = np.asarray(u), np.asarray(v)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_match_sentence_transformers(minilm: openai.OpenAI) -> None:
    out = minilm.embeddings.create(model="minilm", input=MOVIE, encoding_format="float")
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2]
    assert all(len(v) == 384 for v in vectors)
    assert np.linalg.norm(vectors[0]) == pytest.approx(1.0, abs=1e-4)  # Normalize module
    assert _cosine(vectors[0], vectors[1]) == pytest.approx(0.89392, abs=2e-3)
    assert _cosine(vectors[0], vectors[2]) == pytest.approx(-0.02990, abs=2e-3)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3 * 3


def test_base64_is_the_clients_default_and_decodes_to_the_same(
    minilm: openai.OpenAI, minilm_server: RemoteServer
) -> None:
    floats = minilm.embeddings.create(model="minilm", input=MOVIE[0], encoding_format="float")
    default = minilm.embeddings.create(model="minilm", input=MOVIE[0])  # the client sends base64
    np.testing.assert_allclose(default.data[0].embedding, floats.data[0].embedding, atol=1e-6)
    with minilm_server.http(timeout=60) as http:
        raw = http.post(
            "/v1/embeddings",
            json={"model": "minilm", "input": MOVIE[0], "encoding_format": "base64"},
        ).json()
    packed = raw["data"][0]["embedding"]
    assert isinstance(packed, str)
    decoded = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    np.testing.assert_allclose(decoded, floats.data[0].embedding, atol=1e-6)


def test_token_id_inputs(minilm: openai.OpenAI) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    ids = [tokenizer(t)["input_ids"] for t in MOVIE[:2]]
    by_text = minilm.embeddings.create(model="minilm", input=MOVIE[:2], encoding_format="float")
    one = minilm.embeddings.create(model="minilm", input=ids[0], encoding_format="float")
    many = minilm.embeddings.create(model="minilm", input=ids, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=1e-5)
    for a, b in zip(many.data, by_text.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_a_request_of_many_inputs_gives_each_its_own_vector(minilm: openai.OpenAI) -> None:
    """A request's inputs go to the core packed (`AsyncLLM.encode_packed`): each vector is the
    one the input gets in a request of its own, in input order."""
    texts = [f"{MOVIE[i % 3]} number {i}" for i in range(40)]
    together = minilm.embeddings.create(model="minilm", input=texts, encoding_format="float")
    assert [d.index for d in together.data] == list(range(40))
    for i in (0, 7, 21, 39):
        (alone,) = minilm.embeddings.create(
            model="minilm", input=texts[i], encoding_format="float"
        ).data
        np.testing.assert_allclose(together.data[i].embedding, alone.embedding, atol=1e-5)


def test_dimensions_refused_on_minilm(minilm: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        minilm.embeddings.create(model="minilm", input="hi", dimensions=128)
    error = info.value.body
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]
    assert "384" in error["message"]  # names the one size it takes


def test_native_dimensions_accepted(minilm: openai.OpenAI) -> None:
    native = minilm.embeddings.create(
        model="minilm", input=MOVIE[0], dimensions=384, encoding_format="float"
    )
    plain = minilm.embeddings.create(model="minilm", input=MOVIE[0], encoding_format="float")
    assert len(native.data[0].embedding) == 384
    np.testing.assert_allclose(native.data[0].embedding, plain.data[0].embedding, atol=1e-6)


def test_bi_encoder_score(minilm_server: RemoteServer) -> None:
    with minilm_server.http(timeout=60) as http:
        response = http.post(
            "/v1/score", json={"model": "minilm", "text_1": MOVIE[0], "text_2": MOVIE[1:]}
        )
    assert response.status_code == 200, response.text
    scores = [d["score"] for d in response.json()["data"]]
    assert scores == pytest.approx([0.89392, -0.02990], abs=2e-3)


# ---- cross-encoder ----

QUERY = "the quick brown fox"
DOCS = ["the lazy dog", "hello world", "gold", "a query document", "the quick fox"]


def _hf_scores(path: str, pairs: list[tuple[str, str]]) -> list[float]:
    model = BertForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = torch.cat([model(**tokenizer(a, b, return_tensors="pt")).logits for a, b in pairs])
    return torch.sigmoid(logits)[:, 0].tolist()


def test_rerank_orders_by_cross_encoder_score(scorer_server: RemoteServer) -> None:
    expected = _hf_scores(scorer_server.model, [(QUERY, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    with scorer_server.http(timeout=60) as http:
        response = http.post(
            "/v1/rerank",
            json={"model": "scorer", "query": QUERY, "documents": DOCS, "top_n": 3},
        )
        cohere = http.post(
            "/v2/rerank",
            json={
                "query": QUERY,
                "documents": [{"text": d} for d in DOCS],
                "return_documents": False,
            },
        )
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert [r["index"] for r in results] == order[:3]
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order[:3]]
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [expected[i] for i in order[:3]], abs=1e-4
    )
    assert body["usage"]["total_tokens"] > len(DOCS) * 4
    assert cohere.status_code == 200
    assert [r["index"] for r in cohere.json()["results"]] == order
    assert all(r["document"] is None for r in cohere.json()["results"])


def test_score_pairs(scorer_server: RemoteServer) -> None:
    pairs = [("the quick brown fox", "the lazy dog"), ("hello world", "a query document")]
    expected = _hf_scores(scorer_server.model, pairs)
    with scorer_server.http(timeout=60) as http:
        response = http.post(
            "/v1/score",
            json={
                "model": "scorer",
                "text_1": [a for a, _ in pairs],
                "text_2": [b for _, b in pairs],
            },
        )
        many = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == [0, 1]
    assert [d["score"] for d in data] == pytest.approx(expected, abs=1e-4)
    one_to_many = [d["score"] for d in many.json()["data"]]
    assert one_to_many == pytest.approx(
        _hf_scores(scorer_server.model, [(QUERY, d) for d in DOCS]), abs=1e-4
    )
