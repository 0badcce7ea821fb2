"""InprocClient: the EngineCore in the caller's process (tests, debugging); `get_output` runs
one step."""

from __future__ import annotations

from typing import Any

from v1.config import EngineConfig
from v1.core.client import EngineCoreClient
from v1.core.engine_core import EngineCore
from v1.core.executor import ExecutorFactory
from v1.core.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    """The core in this process: `get_output` runs one step."""

    runs_ahead = False

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory) -> None:
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
