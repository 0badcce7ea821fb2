"""Per-endpoint latency histograms (TTFT, inter-token, queue time, end-to-end) for every
endpoint, cache gauges (KV blocks used / total, prefix-cache and cross-cache hit rates) on the
session's tiny Llama and cross-encoder servers."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import RemoteServer

pytestmark = pytest.mark.timeout(300)

LLAMA = '{model_name="tiny-llama"}'


def _count(name: str, endpoint: str, model: str) -> str:
    return f'{name}_count{{endpoint="{endpoint}",model_name="{model}"}}'


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_generation_latencies_per_endpoint(llama_server: RemoteServer) -> None:
    before = llama_server.metrics()
    with llama_server.http(timeout=60) as http:
        body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json={"prompt": "hi", **body}).status_code == 200
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True, **body},
        ) as stream:
            assert sum(1 for line in stream.iter_lines() if line.startswith("data:")) > 4
    after = llama_server.metrics()
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        for name in (
            "v1_time_to_first_token_seconds",
            "v1_request_queue_time_seconds",
            "v1_e2e_request_latency_seconds",
        ):
            assert _delta(before, after, _count(name, endpoint, "tiny-llama")) == 1, name
        itl = _count("v1_inter_token_latency_seconds", endpoint, "tiny-llama")
        assert _delta(before, after, itl) == 3  # 4 tokens: 3 gaps
    assert after[f"v1_kv_cache_total_blocks{LLAMA}"] == 95  # --num-kv-blocks 96 less the null block
    assert after[f"v1_kv_cache_used_blocks{LLAMA}"] == 0
    for rate in ("prefix_cache", "encoder_cache", "cross_cache"):
        assert 0.0 <= after[f"v1_{rate}_hit_rate{LLAMA}"] <= 1.0


def test_prefix_cache_hit_rate_moves(llama_server: RemoteServer) -> None:
    prompt = "a long shared prefix for the cache " * 6
    with llama_server.http(timeout=60) as http:
        for _ in range(2):
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    metrics = llama_server.metrics()
    hits, queries = (
        metrics[f"v1_prefix_cache_hit_tokens{LLAMA}"],
        metrics[f"v1_prefix_cache_queried_tokens{LLAMA}"],
    )
    assert hits > 0
    assert metrics[f"v1_prefix_cache_hit_rate{LLAMA}"] == pytest.approx(hits / queries)


def test_pooling_endpoints_have_queue_time(scorer_server: RemoteServer) -> None:
    before = scorer_server.metrics()
    with scorer_server.http(timeout=60) as http:
        response = http.post("/rerank", json={"query": "q", "documents": ["a", "b"]})
        assert response.status_code == 200
    after = scorer_server.metrics()
    # The alias is counted under the route it aliases.
    for name in ("v1_request_queue_time_seconds", "v1_e2e_request_latency_seconds"):
        assert _delta(before, after, _count(name, "/v1/rerank", "scorer")) == 1, name
    finished = 'v1_request_finish_total{endpoint="/v1/rerank",model_name="scorer",reason="stop"}'
    assert _delta(before, after, finished) == 2
