"""The client factory: which EngineCoreClient a frontend drives (in-process, sync or asyncio
multiprocess, data-parallel) and what runs the model behind the core. It sits above the
executors so the core never names one: the in-process core gets the executor class, a core
process gets the program that picks it (`v1.engine.core_process`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from v1.config import EngineConfig
from v1.core.client import EngineCoreClient
from v1.core.dp_client import AsyncDPClient, SyncDPClient
from v1.core.inproc_client import InprocClient
from v1.core.mp_client import AsyncMPClient, SyncMPClient
from v1.engine.input_processor import InputProcessor
from v1.engine.output_processor import OutputProcessor
from v1.executor import executor_class
from v1.tokenizer import get_tokenizer

T = TypeVar("T")

CORE_PROGRAM = "v1.engine.core_process"
"""The module a core process runs (`python -m`): it picks the executor from the config."""


def make_engine_core_client(
    config: EngineConfig, *, multiprocess: bool, asyncio_mode: bool = False, **client_kwargs: Any
) -> EngineCoreClient:
    """The client for `config`. `client_kwargs` go to the multiprocess clients (explicit
    addresses, a test `executor_factory` path, `ready_timeout_s`)."""
    if config.parallel_config.data_parallel_size > 1:
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 needs the multiprocess engine core")
        dp_class = AsyncDPClient if asyncio_mode else SyncDPClient
        return dp_class(config, program=CORE_PROGRAM, **client_kwargs)
    if not multiprocess:
        if asyncio_mode:
            raise ValueError("the asyncio client needs the multiprocess engine core")
        if client_kwargs:
            raise TypeError(f"the in-process client takes no {sorted(client_kwargs)}")
        return InprocClient(config, executor_class(config))
    mp_class = AsyncMPClient if asyncio_mode else SyncMPClient
    return mp_class(config, program=CORE_PROGRAM, **client_kwargs)


def build_frontend(
    config: EngineConfig, tokenizer: Any = None
) -> tuple[Any, InputProcessor, OutputProcessor]:
    """An engine's frontend: its tokenizer (`tokenizer`, else the model's), input processor and
    output processor."""
    model_config = config.model_config
    tok = tokenizer if tokenizer is not None else get_tokenizer(model_config)
    input_processor = InputProcessor(
        model_config,
        tok,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        model_info=model_config.info,
        lora_config=config.lora_config,
        # N cores hash their own audio, in parallel, instead of the frontend's one thread.
        audio_hash_in_core=config.parallel_config.data_parallel_size > 1,
    )
    return tok, input_processor, OutputProcessor(tok)


def make_frontend_and_client(
    config: EngineConfig,
    build_frontend: Callable[[], T],
    *,
    multiprocess: bool,
    asyncio_mode: bool = False,
    **client_kwargs: Any,
) -> tuple[T, EngineCoreClient]:
    """`build_frontend()` (tokenizer, input and output processors) and the client for `config`.
    With one core process, the frontend is built on a helper thread while the process starts:
    the core's imports and model load run on another CPU, so the tokenizer (~0.5 s for
    Whisper's) costs no start-up time. A frontend error stops the core and is raised, as it was
    when the frontend came first; an in-process or data-parallel core starts after it."""
    if not multiprocess or config.parallel_config.data_parallel_size > 1:
        frontend = build_frontend()
        client = make_engine_core_client(
            config, multiprocess=multiprocess, asyncio_mode=asyncio_mode, **client_kwargs
        )
        return frontend, client
    abort = threading.Event()
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["frontend"] = build_frontend()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            built["error"] = e
            abort.set()

    thread = threading.Thread(target=build, name="v1-frontend-start", daemon=True)
    thread.start()
    try:
        client = make_engine_core_client(
            config,
            multiprocess=True,
            asyncio_mode=asyncio_mode,
            abort_start=abort,
            **client_kwargs,
        )
    except BaseException:
        thread.join()
        if "error" in built:
            raise built["error"] from None  # the frontend's failure aborted the start-up
        raise
    thread.join()
    if "error" in built:
        client.shutdown()
        raise built["error"]
    return built["frontend"], client
