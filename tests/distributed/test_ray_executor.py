"""distributed_executor_backend="ray" on a local Ray cluster (`ray.init(num_cpus=2)`): rank 1
is a Ray actor in a placement group; TP=2 gives the TP=1 greedy tokens and no actor outlives
the engine. Skips only where Ray is not installed (CI installs the `test` extra, which has it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_tensor_parallel import ENGINE_ARGS, generate_tokens, token_prompts
from tests.utils import make_tiny_llama_dir
from v1 import LLM

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_matches_tp1(tmp_path: Path, local_ray: None) -> None:
    path = make_tiny_llama_dir(tmp_path, initializer_range=0.2)
    prompts = token_prompts()
    with LLM(path, multiprocess=False, **ENGINE_ARGS) as llm:
        expected = generate_tokens(prompts)(llm)
    with LLM(
        path,
        multiprocess=False,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE_ARGS,
    ) as llm:
        executor = llm.llm_engine.engine_core.engine_core.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 1
        actor = executor.actors[0]
        assert generate_tokens(prompts)(llm) == expected
    assert executor.actors == [] and executor.placement_group is None
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.run.remote("", 1, ("", ""), "", None), timeout=30)
