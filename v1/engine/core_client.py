"""The client factory: which EngineCoreClient a frontend drives (in-process, sync or asyncio
multiprocess, data-parallel) and what runs the model behind the core. It sits above the
executors so the core never names one: the in-process core gets the executor class, a core
process gets the program that picks it (`v1.engine.core_process`).
"""

from __future__ import annotations

from typing import Any

from v1.config import EngineConfig
from v1.core.client import EngineCoreClient
from v1.core.dp_client import AsyncDPClient, SyncDPClient
from v1.core.inproc_client import InprocClient
from v1.core.mp_client import AsyncMPClient, SyncMPClient
from v1.executor import executor_class

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
