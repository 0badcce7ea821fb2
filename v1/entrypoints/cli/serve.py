"""`v1 serve`: its flags (the server's identity, upload and request limits, shutdown) and
the command, which hands them to the OpenAI-compatible server."""

from __future__ import annotations

import argparse
from typing import Any

from v1 import envs
from v1.entrypoints.cli.engine_args import IGNORED_ENGINE_ARGS, add_engine_args, engine_kwargs


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", help="local model folder or Hugging Face hub id")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)"
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under NAME (needs --enable-lora)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use as `model` (default: the model argument)",
    )
    serve.add_argument(
        "--max-pending",
        type=int,
        default=envs.V1_MAX_PENDING_REQUESTS,
        help="inference requests held at once; more get 503 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-audio-bytes",
        type=int,
        default=envs.V1_MAX_AUDIO_BYTES,
        help="largest audio upload in bytes; larger ones get 413 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-audio-seconds",
        type=float,
        default=float(envs.V1_MAX_AUDIO_SECONDS),
        help="longest decoded audio in seconds (default: %(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=envs.V1_MAX_REQUEST_BYTES,
        help="largest JSON request body in bytes (default: %(default)s)",
    )
    serve.add_argument(
        "--chat-template", default=None, help="a Jinja chat template file (or text) to use"
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP server processes sharing the port and the engine core (one core; each "
        "process parses uploads, decodes audio and handles outputs for its connections: "
        "more processes carry more concurrent requests; default: 4 for a speech model on a "
        "GPU, at most a quarter of the CPUs, else 1)",
    )
    _add_server_limits(serve)
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: %(default)s)",
    )
    add_engine_args(serve, IGNORED_ENGINE_ARGS["serve"])


def _add_server_limits(serve: argparse.ArgumentParser) -> None:
    """`v1 serve` flags for per-request budgets, connection limits and shutdown (one help
    group, in this order)."""
    group = serve.add_argument_group("limits and shutdown")
    _add_request_budgets(group)
    _add_connection_limits(group)
    _add_lifecycle_flags(group)


def _add_request_budgets(group: argparse._ArgumentGroup) -> None:
    """What one request may ask for: prompt size, tokens, wall-clock time."""
    from v1.entrypoints.openai.serving_engine import DEFAULT_MAX_TOKENS_PER_REQUEST

    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt / input text in characters, checked before tokenizing (default: "
        "32 x the model's context length, at least 200000)",
    )
    group.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=DEFAULT_MAX_TOKENS_PER_REQUEST,
        help="input tokens one request may hold over all its prompts, inputs and n samples "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-request-seconds",
        type=float,
        default=1800.0,
        help="wall-clock budget of one inference request; past it its work is stopped and it "
        "ends with a 408 error (0: no budget; default: %(default)s)",
    )


def _add_connection_limits(group: argparse._ArgumentGroup) -> None:
    """HTTP: header and body limits, timeouts and connection counts (uvicorn and the ASGI
    middleware enforce them)."""
    from v1.entrypoints.openai.http_limits import HttpLimits

    http = HttpLimits()
    group.add_argument(
        "--max-header-bytes",
        type=int,
        default=http.max_header_bytes,
        help="request line plus headers, in bytes; more gets 431 (default: %(default)s)",
    )
    group.add_argument(
        "--max-headers",
        type=int,
        default=http.max_headers,
        help="header fields per request; more gets 431 (default: %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=http.header_timeout,
        help="seconds for a request's headers to arrive; then 408 (default: %(default)s)",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=http.max_connections,
        help="open connections; more get 503 (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections-per-client",
        type=int,
        default=http.max_connections_per_client,
        help="open connections from one client address; more get 429 (default: %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds for a request's body to arrive after its headers; then 408 "
        "(default: %(default)s)",
    )


def _add_lifecycle_flags(group: argparse._ArgumentGroup) -> None:
    """Health, shutdown, audio chunking, realtime sessions and what an engine death does."""
    group.add_argument(
        "--health-timeout",
        type=float,
        default=10.0,
        help="/health answers 503 when the engine core does not answer within this many "
        "seconds (default: %(default)s)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to drain in-flight requests (new ones get 503) before "
        "failing them; then exit 0 (default: %(default)s)",
    )
    group.add_argument(
        "--audio-chunk-seconds",
        type=int,
        default=300,
        help="audio a transcription decodes and hands the engine at a time, a multiple of 30 "
        "(bounds its memory and its share of the engine; default: %(default)s)",
    )
    group.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=64,
        help="/v1/realtime transcription sessions open at once; more are refused with 503 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--realtime-idle-timeout",
        type=float,
        default=300.0,
        help="seconds a /v1/realtime session may send no event before it is closed "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="keep answering 503 when the engine dies instead of exiting with code 1",
    )


def run_serve(args: argparse.Namespace) -> int:
    count = args.api_server_count
    if count is not None and count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {count}")
    from v1.entrypoints.openai.api_server_proc import run_server

    return run_server(args, engine_kwargs(args))
