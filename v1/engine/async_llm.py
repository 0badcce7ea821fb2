"""AsyncLLM: the asyncio frontend (the server is built on it) over a multiprocess EngineCore.

Requests are validated by the InputProcessor and sent through the AsyncMPClient; one output
handler task turns EngineCoreOutputs into RequestOutputs (OutputProcessor) and routes them to
per-request queues that `generate` / `encode` iterate. Closing an iterator aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from v1.config import EngineConfig, make_engine_config, pooling_pack_limits
from v1.core.errors import EngineDeadError
from v1.core.protocol import EngineCoreOutput, EngineCoreRequest
from v1.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_output,
    make_beam_search,
    run_beam_search_async,
)
from v1.engine.core_client import build_frontend, make_frontend_and_client
from v1.engine.input_processor import Params
from v1.engine.inputs.encoder_only import UncheckedIdsError, pack_spans
from v1.engine.output_processor import AnyRequestOutput
from v1.logger import init_logger
from v1.lora_request import LoRARequest
from v1.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from v1.pooling_params import PoolingParams, PoolingParamsError
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.core.dp_client import AsyncDPClient
    from v1.core.mp_client import AsyncMPClient
    from v1.engine.transcription import AsyncTranscriber, TranscriptionResult

logger = init_logger(__name__)

_Item = AnyRequestOutput | BaseException
_T = TypeVar("_T")

request_group: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "v1_request_group", default=None
)
"""The fair-share group (EngineCoreRequest.group_id) of requests added from this context: the
server sets it to the HTTP request's id, so every sequence one client request makes (prompts,
inputs, n samples, transcription windows) takes turns with other clients in the core's queue.
Unset: the group of each `generate` / `encode` call is its own request id."""


class OutputObserver(Protocol):
    """Sees every output a request of its context yields (the server's latency metrics)."""

    def on_output(self, output: Any, output_kind: RequestOutputKind) -> None: ...


request_observer: contextvars.ContextVar[OutputObserver | None] = contextvars.ContextVar(
    "v1_request_observer", default=None
)
"""Set by the server per HTTP request: `generate` / `encode` calls from this context report each
output they yield to it (time to first token, inter-token gaps, queue time per endpoint)."""


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, request_id)`: streams RequestOutputs.

    One event loop at a time (it moves to a new loop once the old one is closed). When the
    EngineCore dies, every pending iterator raises EngineDeadError and later calls fail at once.
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        """`engine_args`: flat EngineConfig fields (see `make_engine_config`)."""
        self._setup(make_engine_config(model, **engine_args), tokenizer=None, client_kwargs={})

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, *, tokenizer: Any = None, **client_kwargs: Any
    ) -> AsyncLLM:
        """`client_kwargs` go to the asyncio client (explicit addresses, a test executor factory)."""
        self = cls.__new__(cls)
        self._setup(config, tokenizer=tokenizer, client_kwargs=client_kwargs)
        return self

    def _setup(self, config: EngineConfig, tokenizer: Any, client_kwargs: dict[str, Any]) -> None:
        self.config = config
        self.model_config = config.model_config
        self.model_info = self.model_config.info
        """The frontend's model facts (the server asks its `supported_tasks`)."""

        # The core process starts while the frontend is built (make_frontend_and_client).
        frontend, client = make_frontend_and_client(
            config,
            partial(build_frontend, config, tokenizer),
            multiprocess=True,
            asyncio_mode=True,
            **client_kwargs,
        )
        self.engine_core = cast("AsyncMPClient | AsyncDPClient", client)
        self.tokenizer, self.input_processor, self.output_processor = frontend
        self.transcriber: AsyncTranscriber | None = None
        """Whisper models: the one transcriber of this engine (`transcribe`, the server)."""
        if "transcription" in self.model_info.supported_tasks:
            from v1.engine.transcription import AsyncTranscriber

            self.transcriber = AsyncTranscriber(self)
        self._queues: dict[str, asyncio.Queue[_Item | None]] = {}
        self._core_futures: dict[str, asyncio.Future[EngineCoreOutput]] = {}
        """Requests of `run_core_requests_async` (beam search steps) -> their final output."""
        self._output_handler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: str | None = None
        """Why the engine cannot serve any more (set once the core or the handler died)."""
        self._closed = False
        self._input_pool = ThreadPoolExecutor(1, thread_name_prefix="v1-input")
        """Tokenization and input checks, off the event loop and one at a time (a tokenizer
        is not safe to use from two threads at once)."""
        gc.collect()
        gc.freeze()  # start-up objects live forever: keep them out of cyclic GC scans

    # ---- state ----
    @property
    def errored(self) -> bool:
        """The engine can no longer serve (the core died)."""
        return self._error is not None or self.engine_core.is_dead and not self._closed

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        """A fresh EngineDeadError saying why the engine is down (one per raise)."""
        reason = self._error or self.engine_core.dead_error or "the engine is shut down"
        return EngineDeadError(reason)

    def _check_running(self) -> None:
        if not self.is_running:
            raise self.dead_error

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve."""
        self._check_running()

    async def get_stats(self) -> dict[str, Any]:
        """The core's scheduler and KV cache counters (EngineCore.get_stats)."""
        self._check_running()
        return await self.engine_core.call_utility_async("get_stats")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def run_input_work(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(*args, **kwargs)` on the input thread (tokenizing, checking prompts), so the
        event loop stays free; use it for anything that calls the tokenizer."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._input_pool, partial(fn, *args, **kwargs))

    # ---- requests ----
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
        streamed: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs as they arrive (per `output_kind`); the last one has
        `finished=True`. Cancelling or closing the iterator aborts the request; `abort()` from
        elsewhere ends it without a final output. `lora_request`: the adapter it runs with.
        `streamed`: whether the caller reads the tokens as they come (default: unless
        FINAL_ONLY); False lets an auto num_scheduler_steps run the request in decode bursts,
        so its outputs may carry several tokens each (EngineCoreRequest.streamed)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("generate() needs SamplingParams (use encode() for pooling)")
        core_requests = None
        if lora_request is not None:
            self._check_running()
            core_requests = await self.run_input_work(
                self.input_processor.process_all,
                request_id,
                prompt,
                sampling_params,
                priority=priority,
                lora_request=lora_request,
            )
        async for out in self._run(
            request_id, prompt, sampling_params, priority, output_kind, core_requests, streamed
        ):
            yield out

    async def generate_processed(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams,
        core_requests: list[EngineCoreRequest],
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """As `generate`, for requests built and checked beforehand from `prompt` (a
        transcription window, whose audio was decoded once at the edge): `core_requests` are
        what `InputProcessor.process_all` would give (n > 1: the children of `request_id`)."""
        async for out in self._run(
            request_id, prompt, sampling_params, 0, output_kind, core_requests
        ):
            yield out

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """The pooled output of an encoder-only model, as a one-item stream."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError("encode() needs PoolingParams (use generate() for generation)")
        if "embed" not in self.model_info.supported_tasks:
            raise ValueError(f"{self.model_config.model} is not a pooling (encoder-only) model")
        async for out in self._run(
            request_id, prompt, pooling_params, priority, RequestOutputKind.FINAL_ONLY
        ):
            yield out

    async def encode_packed(
        self, prompts: list[Any], pooling_params: PoolingParams, request_id: str
    ) -> list[PoolingRequestOutput]:
        """The pooled outputs of one client request's inputs, in order (input i's output is
        named `{request_id}-{i}`), sent to the core packed: a few core requests of several
        inputs each (EngineCoreRequest.input_lens, the offline `LLM`'s limits), so a request
        of many inputs costs the core a few requests. Tasks with one vector per input (not
        encode). ValueError (naming the input) on invalid input; a cancelled call (the client
        gone) aborts what it queued."""
        if not isinstance(pooling_params, PoolingParams) or pooling_params.task == "encode":
            raise ValueError("encode_packed() needs PoolingParams of task embed, classify or score")
        if "embed" not in self.model_info.supported_tasks:
            raise ValueError(f"{self.model_config.model} is not a pooling (encoder-only) model")
        self._check_running()
        self._ensure_output_handler()
        builder = self.input_processor.builder
        entries = await self.run_input_work(
            builder.pooling_inputs, prompts, [pooling_params] * len(prompts)
        )
        for i, entry in enumerate(entries):
            if isinstance(entry, PoolingParamsError):
                raise entry  # the params', not this input's (the server names the param)
            if isinstance(entry, ValueError):
                raise ValueError(f"input {i}: {entry}") from entry
        input_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        if any(r in self._queues or r in self.output_processor.request_states for r in input_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        group = request_group.get() or request_id
        max_tokens, max_inputs = pooling_pack_limits(self.config)
        spans = pack_spans([len(ids) for ids, _ in entries], max_tokens, max(max_inputs, 1))
        packs = []
        for j, (a, b) in enumerate(spans):
            try:
                packs.append(
                    builder.pack(f"{request_id}-pack{j}", entries[a:b], pooling_params, group)
                )
            except UncheckedIdsError as e:
                raise ValueError(f"input {a + e.index}: {e}") from e
        q: asyncio.Queue[_Item | None] = asyncio.Queue()
        for input_id in input_ids:
            self._queues[input_id] = q  # every input's output comes to this call
        observer = request_observer.get()
        outputs: dict[str, PoolingRequestOutput] = {}
        try:
            for packed, (a, b) in zip(packs, spans, strict=True):
                self.output_processor.add_packed_request(
                    packed, [(input_ids[i], entries[i][0]) for i in range(a, b)]
                )
                await self.engine_core.add_request_async(packed)
            while len(outputs) < len(input_ids):
                item = q.get_nowait() if not q.empty() else await q.get()
                if item is None:
                    raise asyncio.CancelledError  # aborted
                if isinstance(item, BaseException):
                    raise item
                if observer is not None:
                    observer.on_output(item, RequestOutputKind.FINAL_ONLY)
                outputs[item.request_id] = item
        finally:
            for input_id in input_ids:
                if self._queues.get(input_id) is q:
                    del self._queues[input_id]
            if len(outputs) < len(input_ids):
                core_ids = self.output_processor.abort_requests(p.request_id for p in packs)
                if core_ids:
                    with contextlib.suppress(EngineDeadError):
                        self.engine_core.abort_requests_nowait(core_ids)
        return [outputs[r] for r in input_ids]

    async def transcribe(
        self,
        audio: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **options: Any,
    ) -> list[TranscriptionResult]:
        """Transcribes (or translates) audio with a Whisper model: one TranscriptionResult per
        input, long audio in 30 s windows. `options`: language, task ("transcribe" or
        "translate"), timestamps, prompt, condition_on_previous_text, word_timestamps, ... (see
        `v1.engine.transcription.TranscriptionOptions`)."""
        if self.transcriber is None:
            raise ValueError(
                f"transcribe() needs a Whisper model; {self.model_config.model} is "
                f"{self.model_config.architecture}"
            )
        return await self.transcriber.transcribe(
            audio, request_id=request_id, sampling_params=sampling_params, **options
        )

    async def beam_search(
        self,
        prompt: Any,
        params: BeamSearchParams,
        request_id: str,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> BeamSearchOutput:
        """Beam search for one prompt (see `LLM.beam_search`); `sampling_params` adds rules
        (stop_token_ids, min_tokens, penalties...) to the greedy defaults; every beam runs with
        `lora_request`'s adapter if given. Cancelling it aborts the step in flight."""
        if "generate" not in self.model_info.supported_tasks:
            raise ValueError(f"{self.model_config.model} is an encoder-only model")
        self._check_running()
        search = await self.run_input_work(
            make_beam_search, self, request_id, prompt, params, sampling_params, lora_request
        )
        await run_beam_search_async(
            [search], self.run_core_requests_async, self.release_core_requests
        )
        return beam_search_output(search, self.tokenizer)

    async def run_core_requests_async(
        self, requests: list[EngineCoreRequest], release_ids: Sequence[str] = ()
    ) -> dict[str, EngineCoreOutput]:
        """Runs prepared core requests (beam search steps) past the output processor and
        returns each one's final output. `release_ids`: held requests (`hold_kv`) to release
        once these are queued."""
        self._check_running()
        self._ensure_output_handler()
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[EngineCoreOutput]] = {}
        for request in requests:
            req_id = request.request_id
            if req_id in self._core_futures or req_id in futures or req_id in self._queues:
                raise ValueError(f"request id {req_id!r} is already in use")
            futures[req_id] = loop.create_future()
        self._core_futures.update(futures)
        try:
            for request in requests:
                request.streamed = False  # only the final output is kept
                await self.engine_core.add_request_async(request)
            if release_ids:
                await self.engine_core.abort_requests_async(list(release_ids))
            await asyncio.gather(*futures.values())
        except BaseException:
            unfinished = [r for r, f in futures.items() if not f.done()]
            if unfinished and not self.engine_core.is_dead:
                with contextlib.suppress(EngineDeadError):
                    self.engine_core.abort_requests_nowait(unfinished)
            raise
        finally:
            for req_id in futures:
                self._core_futures.pop(req_id, None)
        return {r: f.result() for r, f in futures.items()}

    def release_core_requests(self, request_ids: list[str]) -> None:
        """Aborts requests of `run_core_requests_async` (held ones are released) without
        waiting; usable while unwinding a cancelled task."""
        if request_ids and not self.engine_core.is_dead:
            with contextlib.suppress(EngineDeadError):
                self.engine_core.abort_requests_nowait(list(request_ids))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stops requests; their iterators end without a final output. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for req_id in ids:
            q = self._queues.pop(req_id, None)
            if q is not None:
                q.put_nowait(None)
        core_ids = self.output_processor.abort_requests(ids)
        if core_ids and not self.engine_core.is_dead:
            await self.engine_core.abort_requests_async(core_ids)

    async def _run(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        priority: int,
        output_kind: RequestOutputKind,
        core_requests: list[EngineCoreRequest] | None = None,
        streamed: bool | None = None,
    ) -> AsyncIterator[Any]:
        q = await self._add_request(
            request_id, prompt, params, priority, output_kind, core_requests, streamed
        )
        observer = request_observer.get()
        finished = False
        try:
            while not finished:
                item = q.get_nowait() if not q.empty() else await q.get()
                if item is None:  # abort() already aborted it
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                if observer is not None:
                    observer.on_output(item, output_kind)
                yield item
        finally:
            # Reached on normal end, cancellation (CancelledError) and aclose (GeneratorExit);
            # the abort must not await here. A queue no longer registered means abort() or a
            # loop change already aborted the request (and the id may be in use again).
            if self._queues.get(request_id) is q:
                del self._queues[request_id]
                if not finished:
                    self._abort_now(request_id)

    async def _add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        priority: int,
        output_kind: RequestOutputKind,
        core_requests: list[EngineCoreRequest] | None = None,
        streamed: bool | None = None,
    ) -> asyncio.Queue[_Item | None]:
        """`core_requests`: built beforehand (`generate_processed`); None: processed here.
        `streamed`: None means unless FINAL_ONLY (see `generate`)."""
        if streamed is None:
            streamed = output_kind != RequestOutputKind.FINAL_ONLY
        self._check_running()
        self._ensure_output_handler()
        if request_id in self._queues or request_id in self.output_processor.parent_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._queues[request_id] = q  # holds the id while the input thread works
        try:
            if core_requests is None:
                core_requests = await self.run_input_work(
                    self.input_processor.process_all, request_id, prompt, params, priority=priority
                )
            if any(r.request_id in self.output_processor.request_states for r in core_requests):
                raise ValueError(f"request id {request_id!r} is already in use")
        except BaseException:
            if self._queues.get(request_id) is q:
                del self._queues[request_id]
            raise
        if self._queues.get(request_id) is not q:  # aborted meanwhile
            return q
        group = request_group.get() or request_id
        for r in core_requests:
            r.group_id = group
        texts = self.input_processor.prompt_texts(prompt)
        self.output_processor.add_user_request(
            request_id, core_requests, params, texts, output_kind=output_kind
        )
        try:
            for request in core_requests:
                request.streamed = streamed
                await self.engine_core.add_request_async(request)
        except BaseException:
            self._queues.pop(request_id, None)
            self.output_processor.abort_requests([request_id])
            raise
        return q

    def _abort_now(self, request_id: str) -> None:
        """Abort without awaiting (safe in `finally` of a cancelled or closed iterator)."""
        core_ids = self.output_processor.abort_requests([request_id])
        if not core_ids:
            return
        with contextlib.suppress(EngineDeadError):  # the core is gone, its requests with it
            self.engine_core.abort_requests_nowait(core_ids)

    # ---- output handling ----
    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("this AsyncLLM is in use by another running event loop")
            self._move_to_loop(loop)
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = loop.create_task(
                self._handle_outputs(), name="AsyncLLM.output_handler"
            )

    def _move_to_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Requests of a closed loop have no consumer left: abort them."""
        stale = list(self._queues)
        self._queues.clear()
        core_ids = self.output_processor.abort_requests(stale) + list(self._core_futures)
        self._core_futures.clear()  # beam steps of the old loop: their awaiters are gone
        if core_ids and not self.engine_core.is_dead:
            self.engine_core.abort_requests_nowait(core_ids)
        self._output_handler = None
        self._loop = loop

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                core_outputs = outputs.outputs
                if self._core_futures:
                    core_outputs = self._take_core_outputs(core_outputs)
                results, reqs_to_abort = self.output_processor.process_outputs(core_outputs)
                for result in results:
                    q = self._queues.get(result.request_id)
                    if q is not None:
                        q.put_nowait(result)
                if reqs_to_abort:
                    await self.engine_core.abort_requests_async(reqs_to_abort)
        except EngineDeadError as e:
            self._fail_all(str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a frontend bug must not hang every caller
            logger.exception("AsyncLLM output handler failed")
            self._fail_all(f"the output handler failed: {type(e).__name__}: {e}")

    def _take_core_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Resolves `run_core_requests_async` futures; returns the other outputs."""
        rest = []
        for out in outputs:
            future = self._core_futures.get(out.request_id)
            if future is None:
                rest.append(out)
            elif out.finished and not future.done():
                future.set_result(out)
        return rest

    def _fail_core_requests(self, reason: str) -> None:
        for future in self._core_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    def _fail_all(self, reason: str) -> None:
        if self._closed:
            return
        self._error = reason
        self._fail_core_requests(reason)
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))

    # ---- lifecycle ----
    def shutdown(self) -> None:
        """Stops the core; pending and later calls raise EngineDeadError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail_core_requests("the engine is shut down")
        for q in self._queues.values():
            q.put_nowait(EngineDeadError("the engine is shut down"))
        handler, self._output_handler = self._output_handler, None
        if handler is not None and not handler.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: it never runs again
                handler.cancel()
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()
