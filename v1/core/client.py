"""EngineCore clients: one interface over an in-process core, a core process driven
synchronously (offline LLM) and one driven from asyncio (AsyncLLM, the server).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from v1.config import EngineConfig
from v1.core.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineDeadError(RuntimeError):
    """The EngineCore died; every pending and later request fails with this."""


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(
        config: EngineConfig, *, multiprocess: bool, asyncio_mode: bool = False
    ) -> EngineCoreClient:
        if config.parallel_config.data_parallel_size > 1:
            if not multiprocess:
                raise ValueError("data_parallel_size > 1 needs the multiprocess engine core")
            from v1.core import dp_client

            if asyncio_mode:
                return dp_client.AsyncDPClient(config)
            return dp_client.SyncDPClient(config)
        if not multiprocess:
            if asyncio_mode:
                raise ValueError("the asyncio client needs the multiprocess engine core")
            return InprocClient(config)
        from v1.core import mp_client

        if asyncio_mode:
            return mp_client.AsyncMPClient(config)
        return mp_client.SyncMPClient(config)

    # sync interface
    def add_request(self, request: EngineCoreRequest) -> None:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is asyncio-only")

    # asyncio interface
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise TypeError(f"{type(self).__name__} is synchronous")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is synchronous")

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The core in this process: `get_output` runs one step."""

    def __init__(self, config: EngineConfig, executor_factory: Any = None) -> None:
        from v1.core.engine_core import EngineCore

        self.engine_core = EngineCore(config, executor_factory)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        outputs.scheduler_stats = self.engine_core.scheduler.make_stats()
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    def shutdown(self) -> None:
        self.engine_core.shutdown()
