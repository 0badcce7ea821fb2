"""What runs the model behind the EngineCore: one worker in the core's process (`uniproc`),
tensor-parallel ranks as worker processes (`multiproc`, `worker_proc`) or Ray actors (`ray`).
The core knows only the `Executor` interface; `executor_class` picks one from the config."""

from __future__ import annotations

from v1.config import EngineConfig
from v1.core.executor import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for `config.parallel_config.executor_backend` (uni, mp or ray)."""
    backend = config.parallel_config.executor_backend
    if backend == "mp":
        from v1.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from v1.executor.ray import RayExecutor

        return RayExecutor
    from v1.executor.uniproc import UniProcExecutor

    return UniProcExecutor
