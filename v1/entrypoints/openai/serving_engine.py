"""What every endpoint family shares: the server settings, the served-model check, the engine's
model kind, and request plumbing (watching for a client disconnect while the engine works,
merging per-prompt output streams, server-sent events that abort the engine when the client goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from v1 import envs
from v1.entrypoints.openai.errors import APIError, ClientDisconnected, bad_request, error_body
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.lora_request import LoRARequest
from v1.pooling_params import PoolingParamsError

T = TypeVar("T")

DEFAULT_MAX_TOKENS_PER_REQUEST = 1 << 16
"""65,536 input tokens per request (e.g. 256 inputs of 256 tokens): a request's work stays in
the order of a minute on a CPU (262,144 embedding tokens took 258 s)."""
MIN_PROMPT_CHARS = 200_000


@dataclass(frozen=True)
class ServerSettings:
    """Server options (`v1 serve` flags other than the engine's)."""

    served_model_names: tuple[str, ...]
    """Names clients may use in `model`; the first is the one reported."""
    model_path: str
    api_key: str | None = None
    max_pending: int = envs.V1_MAX_PENDING_REQUESTS
    """Inference requests held at once; more get 503 with Retry-After."""
    max_audio_bytes: int = envs.V1_MAX_AUDIO_BYTES
    max_audio_seconds: float = float(envs.V1_MAX_AUDIO_SECONDS)
    max_request_bytes: int = envs.V1_MAX_REQUEST_BYTES
    chat_template: str | None = None
    """A Jinja chat template (text) replacing the tokenizer's."""
    max_prompt_chars: int | None = None
    """Longest text of one prompt or input, checked before tokenizing; None: 32 x the model's
    context length, at least 200,000."""
    max_tokens_per_request: int = DEFAULT_MAX_TOKENS_PER_REQUEST
    """Input tokens one request may hold over all its prompts, inputs and samples (prompt
    tokens x n); more gets 400."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM / SIGINT waits for in-flight requests before failing them."""
    keep_alive_on_engine_death: bool = False
    """Keep serving 503s after the engine dies instead of exiting with code 1."""
    audio_chunk_seconds: int = 300
    """Audio a transcription decodes and hands the engine at a time (a multiple of Whisper's
    30 s window): memory and engine share per request are bounded by it, not by the file."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, PEFT adapter folder) pairs served from the start (`--lora-modules name=path`);
    a request's `model` naming one runs with that adapter."""

    body_timeout: float = 60.0
    """Seconds from a request's headers until its whole body has arrived; then 408."""
    max_request_seconds: float | None = 1800.0
    """Wall-clock budget of one inference request; past it the request is stopped (its engine
    work aborted) with a 408 error. None: no budget."""
    health_timeout: float = 10.0
    """/health answers 503 when the engine core does not answer a probe within this many
    seconds (a frozen or stuck core)."""
    max_realtime_sessions: int = 64
    """/v1/realtime sessions open at once; more are refused (503 on the handshake)."""
    realtime_idle_timeout: float = 300.0
    """Seconds a /v1/realtime session may send no event before it is closed."""

    def __post_init__(self) -> None:
        for name in ("body_timeout", "health_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_request_seconds is not None and not self.max_request_seconds > 0:
            raise ValueError(f"max_request_seconds must be > 0, got {self.max_request_seconds}")
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served model names must be non-empty strings")
        for name in (
            "max_pending",
            "max_audio_bytes",
            "max_request_bytes",
            "max_tokens_per_request",
            "max_realtime_sessions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0, got {self.max_audio_seconds}")
        if self.audio_chunk_seconds < 30 or self.audio_chunk_seconds % 30:
            raise ValueError(
                f"audio_chunk_seconds must be a positive multiple of 30, got "
                f"{self.audio_chunk_seconds}"
            )
        if not self.realtime_idle_timeout > 0:
            raise ValueError(f"realtime_idle_timeout must be > 0, got {self.realtime_idle_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class LoRAModules:
    """The LoRA adapters the server serves by name: `--lora-modules` at start, then
    `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`. Each load gets a new adapter id, so
    a name loaded again from a changed folder never reuses the old one's caches."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.base_names = settings.served_model_names
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in settings.lora_modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> LoRARequest:
        """Reads and checks the adapter (ValueError on anything wrong) and serves it."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings")
        if name in self.by_name or name in self.base_names:
            raise ValueError(f"the name {name!r} is already served")
        request = LoRARequest(name, self._next_id, path)
        self.engine.input_processor.check_lora(request)
        self._next_id += 1
        self.by_name[name] = request
        return request

    def unload(self, name: str) -> None:
        """Stops serving `name` (requests already running with it finish)."""
        request = self.by_name.pop(name, None)
        if request is None:
            raise APIError(
                404, f"no LoRA adapter named {name!r}", param="lora_name", code="model_not_found"
            )
        self.engine.input_processor.forget_lora(request.lora_int_id)


class ServingBase:
    """Shared state and checks of the endpoint families."""

    loras: LoRAModules | None = None
    """The server's adapters (set by build_app; None: checks see base names only)."""
    serves_lora: ClassVar[bool] = False
    """Whether the family runs requests with an adapter (else naming one is a 400)."""

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.model_config = engine.model_config
        self.model_info = engine.model_info
        self.inputs = engine.input_processor.builder
        """The engine's input builder: what a prompt of this model kind becomes."""
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len: int = self.model_config.effective_max_model_len
        context = max(self.max_model_len, self.model_config.max_encoder_len)
        self.max_prompt_chars = settings.max_prompt_chars or max(32 * context, MIN_PROMPT_CHARS)

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def check_model(self, requested: str | None) -> str:
        """The served name to report (a LoRA adapter's name for its requests); 404 for a model
        this server does not serve."""
        if requested is None or requested in self.settings.served_model_names:
            return self.model_name
        if self.loras is not None and requested in self.loras.by_name:
            if not self.serves_lora:
                raise APIError(
                    400,
                    f"{requested!r} is a LoRA adapter; adapters are served on /v1/completions, "
                    "/v1/chat/completions and /v1/audio/* (this endpoint runs the base model "
                    "only)",
                    param="model",
                )
            return requested
        raise APIError(
            404,
            f"the model {requested!r} does not exist on this server; it serves "
            f"{list(self.settings.served_model_names)}",
            param="model",
            code="model_not_found",
        )

    def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a request's reported model name selects (None: the base model)."""
        return self.loras.by_name.get(model) if self.loras is not None else None

    # ---- input limits ----
    def check_chars(self, num_chars: int, where: str, param: str) -> None:
        """The character limit, checked before a text is tokenized (a huge prompt must not
        hold the tokenizer thread for seconds)."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"{where} has {num_chars} characters, more than this server's limit of "
                f"{self.max_prompt_chars} (--max-prompt-chars)",
                param=param,
                code="context_length_exceeded",
            )

    def check_token_budget(self, num_tokens: int, param: str) -> None:
        """--max-tokens-per-request over all the inputs (and samples) of one request."""
        limit = self.settings.max_tokens_per_request
        if num_tokens > limit:
            raise bad_request(
                f"the request holds {num_tokens} input tokens over all its inputs, more than "
                f"this server's limit of {limit} per request (--max-tokens-per-request); split "
                "it into smaller requests",
                param=param,
                code="request_too_large",
            )

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs tokenizer work on the engine's input thread, off the event loop."""
        return await self.engine.run_input_work(fn, *args, **kwargs)

    # ---- model tasks ----
    @property
    def is_generator(self) -> bool:
        """Text generation from text prompts (a speech model generates from audio)."""
        tasks = self.model_info.supported_tasks
        return "generate" in tasks and "transcription" not in tasks

    @property
    def is_pooling(self) -> bool:
        return "embed" in self.model_info.supported_tasks

    def wrong_endpoint(self, endpoint: str, needs: str) -> APIError:
        mc = self.model_config
        return bad_request(
            f"{endpoint} needs {needs}; the model {self.model_name!r} ({mc.architecture}) is "
            f"{self.model_info.description}",
            param="model",
            code="wrong_model_kind",
        )


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, cancelled (aborting its engine requests) if the client disconnects
    first; then raises ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def prime_all(request: Request, gens: Sequence[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """Pulls the first item of every stream (surfacing input errors before any byte of a
    streamed response is sent) and returns streams that start with it again. On any failure
    every stream is closed (aborting its engine request)."""

    async def first(gen: AsyncIterator[T]) -> list[T]:
        try:
            return [await gen.__anext__()]
        except StopAsyncIteration:
            return []

    try:
        firsts = await run_until_disconnected(request, asyncio.gather(*(first(g) for g in gens)))
    except BaseException:
        await close_all(gens)
        raise
    return [_prepend(head, gen) for head, gen in zip(firsts, gens, strict=True)]


async def _prepend(head: list[T], gen: AsyncIterator[T]) -> AsyncIterator[T]:
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        for item in head:
            yield item
        async for item in gen:
            yield item


async def close_all(gens: Sequence[AsyncIterator[Any]]) -> None:
    for gen in gens:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) from several streams as items arrive; closing the merged stream
    cancels and closes every input stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """asyncio.gather that cancels (aborting their engine requests) the rest when one fails."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def map_input_errors(awaitable: Awaitable[T]) -> T:
    """`await awaitable` with the engine's input errors (ValueError, AudioError included) as
    400s (naming the field at fault when the error does, as PoolingParamsError); EngineDeadError
    is left to the app's handler (503)."""
    try:
        return await awaitable
    except ValueError as e:
        param = e.param if isinstance(e, PoolingParamsError) else None
        raise bad_request(str(e), param=param) from e


def json_response(body: BaseModel, status_code: int = 200) -> Response:
    """A pydantic body as JSON (non-finite floats become null instead of failing)."""
    return Response(body.model_dump_json(), status_code, media_type="application/json")


def sse_model(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def sse_event(data: Any) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


def sse_error(error: APIError) -> str:
    return sse_event(error_body(error.message, error.error_type, error.param, error.code))


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """text/event-stream whose generator is closed (aborting its engine requests) as soon as the
    client disconnects, even while no event is being produced; `on_close` runs at the end."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run_then_stop(func: Callable[[], Awaitable[None]]) -> None:
                    with contextlib.suppress(OSError):
                        await func()
                    tg.cancel_scope.cancel()

                tg.start_soon(run_then_stop, partial(self.stream_response, send))
                await run_then_stop(partial(self.listen_for_disconnect, receive))
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()


LORA_UNREADABLE = "could not be read by the worker"
"""The words of the engine's error for a request whose LoRA adapter the worker cannot read
(v1/lora/manager.py): the request's model is unusable, which the client is told (400 naming
the adapter), not a hidden internal error."""


def lora_unreadable_error(error: str) -> APIError | None:
    """A 400 on `model` for an engine error that is an unreadable LoRA adapter; else None."""
    if "LoRA adapter '" in error and LORA_UNREADABLE in error:
        return APIError(400, error, param="model", code="lora_adapter_unreadable")
    return None
