"""The OpenAI-compatible HTTP server: `build_app(engine, args)` and `serve_engine(args, engine)`
(`api_server_proc.run_server` starts the engine and the server processes).

Routes /v1/models, /health, /metrics, /version and the endpoint families (serving_*.py) over one
AsyncLLM, behind `middleware.ServerMiddleware` (API key, in-flight bound, body limits, request
budget, metrics). /health answers 503 when the engine died or its core does not answer a probe
within --health-timeout (a frozen core).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from v1.entrypoints.openai.errors import (
    RETRY_AFTER_S,
    APIError,
    ClientDisconnected,
    bad_request,
    engine_dead_error,
    error_response,
    install_error_handlers,
)
from v1.entrypoints.openai.form_fields import check_form_fields
from v1.entrypoints.openai.http_limits import HttpLimits, limited_protocol
from v1.entrypoints.openai.lifecycle import DrainingServer, ServerLifecycle
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.entrypoints.openai.middleware import ServerMiddleware
from v1.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from v1.entrypoints.openai.realtime import add_realtime_routes
from v1.entrypoints.openai.serving_completions import ServingCompletions
from v1.entrypoints.openai.serving_embeddings import ServingEmbeddings
from v1.entrypoints.openai.serving_engine import LoRAModules, ServerSettings, json_response
from v1.entrypoints.openai.serving_score import ServingScore
from v1.entrypoints.openai.serving_tokenization import ServingTokenization
from v1.entrypoints.openai.serving_transcriptions import (
    AudioRequest,
    ServingTranscriptions,
    decoding_form,
)
from v1.logger import init_logger
from v1.version import __version__

logger = init_logger(__name__)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    names = getattr(args, "served_model_name", None) or [args.model]
    kwargs: dict[str, Any] = {}
    for name in (
        "max_pending",
        "max_audio_bytes",
        "max_audio_seconds",
        "max_request_bytes",
        "max_prompt_chars",
        "max_tokens_per_request",
        "shutdown_timeout",
        "keep_alive_on_engine_death",
        "audio_chunk_seconds",
        "body_timeout",
        "max_request_seconds",
        "health_timeout",
        "max_realtime_sessions",
        "realtime_idle_timeout",
    ):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    lora_modules = getattr(args, "lora_modules", None)
    if lora_modules:
        kwargs["lora_modules"] = tuple(parse_lora_module(m) for m in lora_modules)
    if kwargs.get("max_request_seconds") == 0:
        kwargs["max_request_seconds"] = None
    return ServerSettings(
        served_model_names=tuple(names),
        model_path=args.model,
        api_key=getattr(args, "api_key", None) or None,
        chat_template=getattr(args, "chat_template", None),
        **kwargs,
    )


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` of --lora-modules -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


def build_app(engine: Any, args: argparse.Namespace | ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM); it shuts the engine down on exit."""
    settings = args if isinstance(args, ServerSettings) else settings_from_args(args)
    metrics = ServerMetrics(settings.model_name)
    lifecycle = ServerLifecycle(settings.shutdown_timeout, settings.keep_alive_on_engine_death)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s as %s", settings.model_path, list(settings.served_model_names))
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(
        title="v1-engine OpenAI-compatible server",
        version=__version__,
        lifespan=lifespan,
    )
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    app.add_middleware(ServerMiddleware, settings=settings, metrics=metrics, lifecycle=lifecycle)
    lora_config = getattr(getattr(engine, "config", None), "lora_config", None)
    lora_on = lora_config is not None and lora_config.enable_lora
    app.state.loras = LoRAModules(engine, settings) if lora_on else None
    if settings.lora_modules and app.state.loras is None:
        raise ValueError("--lora-modules needs --enable-lora")
    _add_info_routes(app, engine, settings, metrics)
    _add_inference_routes(app, engine, settings, metrics)
    add_realtime_routes(app, engine, settings)
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    return app


def _add_info_routes(
    app: FastAPI, engine: Any, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    max_model_len = engine.model_config.effective_max_model_len

    def cards() -> list[ModelCard]:
        base = [
            ModelCard(id=name, root=settings.model_path, max_model_len=max_model_len)
            for name in settings.served_model_names
        ]
        loras = app.state.loras.by_name.values() if app.state.loras is not None else ()
        return base + [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=settings.model_name,
                max_model_len=max_model_len,
            )
            for lora in loras
        ]

    probe = CoreProbe(engine, settings.health_timeout)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.errored:
            return error_response(engine_dead_error(engine.dead_error))
        if not await probe.responsive():
            return error_response(
                APIError(
                    503,
                    f"the engine core did not answer within {settings.health_timeout:g} s "
                    "(--health-timeout): it is stuck or overloaded",
                    code="engine_unresponsive",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body, content_type = await metrics.render(engine)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=cards()))

    _add_lora_routes(app)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        for card in cards():
            if card.id == model_id:
                return json_response(card)
        raise APIError(
            404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )


def _add_lora_routes(app: FastAPI) -> None:
    """vLLM's run-time adapter endpoints (JSON bodies: lora_name, lora_path)."""

    def registry() -> LoRAModules:
        if app.state.loras is None:
            raise bad_request("LoRA is not enabled on this server (--enable-lora)")
        return app.state.loras

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise bad_request(f"the body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body, loras = await body_of(request), registry()
        name, path = body.get("lora_name"), body.get("lora_path")
        try:
            await loras.engine.run_input_work(loras.load, name, path)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from e
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body, loras = await body_of(request), registry()
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("lora_name must be a non-empty string", param="lora_name")
        loras.unload(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)


class CoreProbe:
    """Whether the EngineCore still answers: one utility call at a time (a frozen core gets no
    pile of them), answered between its steps; a core that has not answered the current probe
    within `timeout` seconds is unresponsive. A success is reused for a second."""

    _FRESH_S = 1.0

    def __init__(self, engine: Any, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self._task: asyncio.Future[Any] | None = None
        self._started = 0.0
        self._ok_at = -float("inf")

    async def responsive(self) -> bool:
        now = time.monotonic()
        if now - self._ok_at < self._FRESH_S:
            return True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._ping())
            self._started = now
        left = self._started + self.timeout - now
        if left > 0:
            await asyncio.wait({self._task}, timeout=left)
        if not self._task.done() or self._task.cancelled() or self._task.exception():
            return False
        self._ok_at = time.monotonic()
        return True

    async def _ping(self) -> None:
        await self.engine.get_stats()


def _add_inference_routes(
    app: FastAPI, engine: Any, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    completions = ServingCompletions(engine, settings, metrics)
    embeddings = ServingEmbeddings(engine, settings, metrics)
    scores = ServingScore(engine, settings, metrics)
    audio = ServingTranscriptions(engine, settings, metrics)
    tokenization = ServingTokenization(engine, settings, metrics)
    for serving in (completions, embeddings, scores, audio, tokenization):
        serving.loras = app.state.loras

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await completions.create_chat_completion(body, request)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create_embedding(body, request)

    async def create_score(body: ScoreRequest, request: Request) -> Response:
        return await scores.create_score(body, request)

    async def create_rerank(body: RerankRequest, request: Request) -> Response:
        return await scores.create_rerank(body, request)

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, create_score, methods=["POST"])
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        app.add_api_route(path, create_rerank, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(body)

    _add_audio_routes(app, audio)


def _add_audio_routes(app: FastAPI, audio: ServingTranscriptions) -> None:
    """The multipart upload routes: transcriptions and translations."""
    upload_limits: dict[str, Any] = {
        "form_limits": {"max_files": 1, "max_fields": 40, "max_part_size": 64 << 10},
        "dependencies": [Depends(check_form_fields)],  # unknown form fields are a 400
    }

    @app.post("/v1/audio/transcriptions", **upload_limits)
    async def create_transcription(
        request: Request,
        file: Annotated[UploadFile, File()],
        decoding: Annotated[dict[str, Any], Depends(decoding_form)],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        temperature: Annotated[float, Form()] = 0.0,
        response_format: Annotated[str, Form()] = "json",
        timestamp_granularities: Annotated[
            list[str] | None, Form(alias="timestamp_granularities[]")
        ] = None,
        stream: Annotated[bool, Form()] = False,
        include: Annotated[list[str] | None, Form(alias="include[]")] = None,
        chunking_strategy: Annotated[str | None, Form()] = None,
        hallucination_silence_threshold: Annotated[float | None, Form()] = None,
        multilingual: Annotated[bool | None, Form()] = None,
    ) -> Response:
        _reject_unsupported_audio(include, chunking_strategy)
        only_here = {
            "hallucination_silence_threshold": hallucination_silence_threshold,
            "multilingual": multilingual,
        }
        decoding.update({k: v for k, v in only_here.items() if v is not None})
        req = AudioRequest(
            "transcribe",
            file,
            model,
            language,
            prompt,
            temperature,
            response_format,
            timestamp_granularities or [],
            stream,
            decoding,
        )
        return await audio.create(req, request)

    @app.post("/v1/audio/translations", **upload_limits)
    async def create_translation(
        request: Request,
        file: Annotated[UploadFile, File()],
        decoding: Annotated[dict[str, Any], Depends(decoding_form)],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        temperature: Annotated[float, Form()] = 0.0,
        response_format: Annotated[str, Form()] = "json",
        stream: Annotated[bool, Form()] = False,
    ) -> Response:
        req = AudioRequest(
            "translate",
            file,
            model,
            language,
            prompt,
            temperature,
            response_format,
            [],
            stream,
            decoding,
        )
        return await audio.create(req, request)


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    names = (
        "max_header_bytes",
        "max_headers",
        "header_timeout",
        "max_connections",
        "max_connections_per_client",
    )
    return HttpLimits(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


def _reject_unsupported_audio(include: list[str] | None, chunking_strategy: str | None) -> None:
    """400 naming audio options this server would otherwise silently ignore."""
    if include:
        raise APIError(
            400,
            f"include {include} is not supported (no per-token logprobs in transcriptions)",
            param="include",
        )
    if chunking_strategy not in (None, "auto"):
        raise APIError(
            400,
            "chunking_strategy must be 'auto' (fixed 30 s windows); voice-activity chunking "
            "is not supported",
            param="chunking_strategy",
        )


def serve_engine(
    args: argparse.Namespace,
    engine: Any,
    *,
    sock: Any = None,
    children: Any = None,
    on_started: Any = None,
) -> int:
    """Serves `engine` (an AsyncLLM) on `args.host:args.port`, or on the bound `sock`, until
    a drain or the engine's death, then shuts it down; `children`: the other API server
    processes, watched (and drained with this one) by the lifecycle, stopped before the
    engine; `on_started()`: called once it serves. The caller checked the server's arguments
    (`check_server_args`) before it started the engine. Returns the process exit code."""
    import uvicorn

    settings = settings_from_args(args)
    try:
        app = build_app(engine, settings)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            http=limited_protocol(http_limits_from_args(args)),
            log_level=getattr(args, "uvicorn_log_level", "info"),
            access_log=False,
            timeout_keep_alive=int(getattr(args, "keep_alive_timeout", 5)),
            timeout_graceful_shutdown=2,  # after our own drain (ServerLifecycle)
        )
        lifecycle: ServerLifecycle = app.state.lifecycle
        server = DrainingServer(config, lifecycle, engine, children, on_started)
        server.run(sockets=None if sock is None else [sock])
    finally:
        if children is not None:  # their drains end before the core they share goes
            children.stop(timeout=settings.shutdown_timeout + 5)
        engine.shutdown()  # idempotent; covers a failed bind, where lifespan never ran
    if not server.started and lifecycle.exit_code == 0:
        print("v1 serve: error: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return lifecycle.exit_code


def check_server_args(args: argparse.Namespace) -> None:
    """The server's own arguments checked (ValueError), before an engine starts for them."""
    settings_from_args(args)
    http_limits_from_args(args)
