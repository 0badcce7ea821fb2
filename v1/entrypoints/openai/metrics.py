"""Prometheus metrics of the API server (prometheus_client, one registry per app).

Counters and latency histograms are updated as requests run; the engine gauges (waiting, running,
KV cache usage) are refreshed from `AsyncLLM.get_stats()` on every scrape of /metrics.

Several API server processes (`v1 serve --api-server-count N`) run prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by `v1 serve` before any metric exists):
each process writes its values to that folder and /metrics, whichever process answers, sums
the counters and histograms of all of them, and the requests in flight of the live ones; the
engine gauges are those of the latest scrape.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from v1 import envs
from v1.core.errors import EngineDeadError
from v1.logger import init_logger
from v1.outputs import RequestOutput, RequestOutputKind

logger = init_logger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    """Every metric the server exports; `render()` is the body of /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._add_http_metrics()
        self._add_engine_gauges()
        self._add_token_metrics()

    def _add_http_metrics(self) -> None:
        """What the server itself counts: requests by endpoint and status, in flight, refused,
        the engine's health, end-to-end latency and how sequences ended."""
        r = self.registry
        self.requests = Counter(
            "v1_http_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "v1_http_request_errors",
            "HTTP requests answered with a 4xx or 5xx status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "v1_http_requests_in_flight",
            "Inference requests the server holds now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rejected = Counter(
            "v1_http_requests_rejected",
            "Requests refused with 503 because the server was full.",
            registry=r,
        )
        self.engine_healthy = Gauge(
            "v1_engine_healthy",
            "1 while the engine core is alive.",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.e2e = Histogram(
            "v1_e2e_request_latency_seconds",
            "Time from arrival to the end of a request (streams: the last byte), per endpoint.",
            ["model_name", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "v1_request_finish",
            "Sequences (choices, inputs, transcriptions) by how they ended: stop, length, "
            "abort (the client left) or error.",
            ["model_name", "endpoint", "reason"],
            registry=r,
        )

    def _add_engine_gauges(self) -> None:
        """The engine's figures (`AsyncLLM.get_stats()`, refreshed on each scrape), labelled
        with the model name: queues, KV blocks, prefix / encoder / cross caches."""
        gauge = self._labelled(Gauge)
        self.waiting = gauge("v1_num_requests_waiting", "Requests waiting in the engine's queue.")
        self.running = gauge("v1_num_requests_running", "Requests the engine is running.")
        self.kv_usage = gauge("v1_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_used_blocks = gauge("v1_kv_cache_used_blocks", "KV cache blocks in use.")
        self.kv_total_blocks = gauge("v1_kv_cache_total_blocks", "KV cache blocks in all.")
        self.prefix_queries = gauge(
            "v1_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache since start (hit rate: hits / queried).",
        )
        self.prefix_hits = gauge(
            "v1_prefix_cache_hit_tokens", "Of those, tokens found cached since start."
        )
        self.encoder_lookups = gauge(
            "v1_encoder_cache_lookups",
            "Requests with an encoder input admitted since start (encoder and cross caches).",
        )
        self.encoder_runs = gauge(
            "v1_encoder_runs",
            "Of those, encoder runs (the rest reused a cached encoder output and its cross "
            "blocks' content: hit rate = 1 - runs / lookups).",
        )
        self.preemptions = gauge("v1_num_preemptions", "Preemptions since the engine started.")
        self.prefix_hit_rate = gauge(
            "v1_prefix_cache_hit_rate", "Prefix-cache hits / queried prompt tokens since start."
        )
        self.encoder_hit_rate = gauge(
            "v1_encoder_cache_hit_rate",
            "Encoder inputs served from the encoder cache (no encoder run) / encoder inputs "
            "admitted, since start.",
        )
        self.cross_lookups = gauge(
            "v1_cross_cache_lookups",
            "Cross-attention cache lookups by encoder content hash since start (one entry per "
            "encoder input, per-layer K/V or absorbed encoder states).",
        )
        self.cross_hits = gauge(
            "v1_cross_cache_hits", "Of those, lookups that found the entry already cached."
        )
        self.cross_hit_rate = gauge(
            "v1_cross_cache_hit_rate", "Cross-cache hits / lookups since start (0 without any)."
        )

    def _add_token_metrics(self) -> None:
        """Tokens and audio processed, and the per-token latencies (TTFT, ITL, queue time)."""
        r, counter = self.registry, self._labelled(Counter)
        self.prompt_tokens = counter("v1_prompt_tokens", "Prompt (input) tokens processed.")
        self.generation_tokens = counter("v1_generation_tokens", "Tokens generated.")
        self.audio_seconds = counter(
            "v1_audio_seconds_processed", "Seconds of audio transcribed or translated."
        )
        self.ttft = Histogram(
            "v1_time_to_first_token_seconds",
            "Time from arrival to the first output token, per endpoint.",
            ["model_name", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "v1_inter_token_latency_seconds",
            "Time between output tokens of a request, per endpoint.",
            ["model_name", "endpoint"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "v1_request_queue_time_seconds",
            "Time from a request's arrival in the engine to the first step of its first "
            "sequence, per endpoint.",
            ["model_name", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _labelled(self, kind: type) -> Any:
        """A factory of `kind` metrics bound to this server's model_name label."""

        def make(name: str, documentation: str, **kwargs: Any) -> Any:
            if kind is Gauge:  # the engine's own figures: the latest scrape's, one series
                kwargs.setdefault("multiprocess_mode", "mostrecent")
            metric = kind(name, documentation, ["model_name"], registry=self.registry, **kwargs)
            return metric.labels(model_name=self.model_name)

        return make

    def observe_transcription(self, result: Any) -> None:
        """A finished transcription / translation (a TranscriptionResult): its audio seconds,
        and its text tokens as generation tokens."""
        self.audio_seconds.inc(result.duration)
        num_tokens = sum(len(segment.tokens) for segment in result.segments)
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()

    def observe_e2e(self, endpoint: str, seconds: float) -> None:
        self.e2e.labels(self.model_name, endpoint).observe(seconds)

    def observe_finish(self, endpoint: str, reason: str | None, count: int = 1) -> None:
        if count > 0:
            self.finished.labels(self.model_name, endpoint, reason or "stop").inc(count)

    async def render(self, engine: Any) -> tuple[bytes, str]:
        """Refreshes the engine gauges (when the engine is alive) and renders every metric."""
        healthy = not engine.errored
        if healthy:
            try:
                self._set_engine_stats(await engine.get_stats())
            except EngineDeadError:
                healthy = False
        self.engine_healthy.set(1 if healthy else 0)
        if not healthy:
            self.running.set(0)
            self.waiting.set(0)
        return generate_latest(self._exported()), CONTENT_TYPE_LATEST

    def _exported(self) -> CollectorRegistry:
        """This process's registry, or, with several API server processes, every process's
        values gathered from the multiprocess folder."""
        folder = envs.prometheus_multiproc_dir()
        if not folder:
            return self.registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=folder)
        return registry

    def _set_engine_stats(self, stats: dict[str, Any]) -> None:
        self.waiting.set(stats.get("num_waiting_reqs", 0))
        self.running.set(stats.get("num_running_reqs", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        self.kv_used_blocks.set(stats.get("num_used_blocks", 0))
        self.kv_total_blocks.set(stats.get("num_total_blocks", 0))
        self.preemptions.set(stats.get("num_preemptions", 0))
        self.prefix_queries.set(stats.get("prefix_cache_queries", 0))
        self.prefix_hits.set(stats.get("prefix_cache_hits", 0))
        lookups, runs = stats.get("num_encoder_lookups", 0), stats.get("num_encoder_runs", 0)
        self.encoder_lookups.set(lookups)
        self.encoder_runs.set(runs)
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.encoder_hit_rate.set(1.0 - runs / lookups if lookups else 0.0)
        cross_lookups = stats.get("cross_cache_lookups", 0)
        cross_hits = stats.get("cross_cache_hits", 0)
        self.cross_lookups.set(cross_lookups)
        self.cross_hits.set(cross_hits)
        self.cross_hit_rate.set(cross_hits / cross_lookups if cross_lookups else 0.0)


class RequestObserver:
    """Latency of one HTTP request, for every endpoint, from the outputs AsyncLLM yields to it
    (`v1.engine.async_llm.request_observer`): time to its first output token, the gaps between
    its tokens (all its sequences together), and its queue time (arrival in the engine to the
    first step of its first sequence). End-to-end latency is observed by the middleware."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.labels = (metrics.model_name, endpoint)
        self.arrival = time.perf_counter()
        self._last: float | None = None
        self._queued = False
        self._seen: dict[tuple[str, int], int] = {}
        """(request id, choice index) -> tokens seen (cumulative outputs)."""

    def on_output(self, output: Any, output_kind: RequestOutputKind) -> None:
        if not self._queued and getattr(output, "queue_time", None) is not None:
            self._queued = True
            self.metrics.queue_time.labels(*self.labels).observe(output.queue_time)
        if not isinstance(output, RequestOutput):
            return  # pooling: one result, no tokens
        num_new = 0
        for c in output.outputs:
            if output_kind == RequestOutputKind.DELTA:
                num_new += len(c.token_ids)
            else:
                key = (output.request_id, c.index)
                num_new += len(c.token_ids) - self._seen.get(key, 0)
                self._seen[key] = len(c.token_ids)
        if num_new > 0:
            self.tokens(num_new)

    def tokens(self, num_new_tokens: int) -> None:
        t = time.perf_counter()
        if self._last is None:
            self.metrics.ttft.labels(*self.labels).observe(t - self.arrival)
        else:
            gap = (t - self._last) / num_new_tokens
            itl = self.metrics.itl.labels(*self.labels)
            for _ in range(min(num_new_tokens, 64)):
                itl.observe(gap)
        self._last = t


class RequestTimer:
    """Token counters of one completions or chat request (its latencies: RequestObserver)."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint

    def tokens(self, num_new_tokens: int) -> None:
        """Called per engine output carrying `num_new_tokens` new tokens (summed over choices)."""
        if num_new_tokens > 0:
            self.metrics.generation_tokens.inc(num_new_tokens)

    def finish(self, num_prompt_tokens: int) -> None:
        """(End-to-end latency is observed by the server middleware for every endpoint.)"""
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
