"""One EngineCore process shared by several frontends (the API server processes of `v1 serve
--api-server-count`): the owner starts it with `extra_frontends`, the others attach to the
addresses it names; each frontend gets back only its own requests' outputs and utility
answers, an attached frontend leaving does not stop the core, the owner leaving does, and every
attached frontend is told."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.core.test_mp_client import (
    ScriptedExecutor,
    collect,
    factory_path,
    request,
    scripted_config,
    tokens,
)
from v1.config import EngineConfig
from v1.core.errors import EngineDeadError
from v1.core.mp_client import SyncMPClient
from v1.core.process_handles import AttachedCore
from v1.core.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason
from v1.engine.core_client import CORE_PROGRAM

pytestmark = pytest.mark.timeout(120)


def owner(config: EngineConfig, extra: int) -> SyncMPClient:
    return SyncMPClient(
        config,
        program=CORE_PROGRAM,
        executor_factory=factory_path(ScriptedExecutor),
        extra_frontends=extra,
    )


def attach(config: EngineConfig, core: SyncMPClient, index: int) -> SyncMPClient:
    input_address, output_address = core.frontend_addresses[index - 1]
    spec = AttachedCore(core.pid, input_address, output_address, index)
    return SyncMPClient(config, program=CORE_PROGRAM, attach=spec)


def drain(client: SyncMPClient, seconds: float) -> list[str]:
    """Request ids of every output `client` gets within `seconds`."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            outs: EngineCoreOutputs = client.get_output(timeout=0.05)
        except TimeoutError:
            continue
        seen += [o.request_id for o in outs.outputs]
    return seen


@pytest.fixture(scope="module")
def config(tiny_llama_dir: str) -> EngineConfig:
    return scripted_config(tiny_llama_dir)


def test_each_frontend_gets_its_own_outputs_and_answers(config: EngineConfig) -> None:
    core = owner(config, extra=2)
    try:
        assert len(core.frontend_addresses) == 2
        first, second = attach(config, core, 1), attach(config, core, 2)
        assert first.max_model_len == second.max_model_len == core.max_model_len
        clients = {"o": core, "f": first, "s": second}
        for name, client in clients.items():
            client.add_request(request(f"{name}-a", max_tokens=3))
            client.add_request(request(f"{name}-b", max_tokens=5, prompt=[1] * 9))
        for name, client in clients.items():
            got = collect(client, {f"{name}-a", f"{name}-b"})
            assert set(got) == {f"{name}-a", f"{name}-b"}  # nobody else's
            assert tokens(got[f"{name}-a"]) == [13, 14, 15]
            assert got[f"{name}-b"][-1].finish_reason == FinishReason.LENGTH
        # Every frontend's call ids start at 1: answers go to the caller, not by call id alone.
        results: dict[str, list[Any]] = {name: [] for name in clients}

        def ask(name: str, client: SyncMPClient) -> None:
            for _ in range(10):
                results[name].append(client.call_utility("get_config_info"))

        threads = [threading.Thread(target=ask, args=item) for item in clients.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(len(r) == 10 and r[0]["block_size"] == 4 for r in results.values())
        # One frontend's abort leaves the others' requests alone; its own ends silently.
        first.add_request(request("f-long", max_tokens=200))
        second.add_request(request("s-long", max_tokens=30))
        time.sleep(0.2)
        first.abort_requests(["f-long"])
        got = collect(second, {"s-long"})
        assert len(tokens(got["s-long"])) == 30
        drain(first, 0.3)  # what it sent before the abort landed
        assert "f-long" not in drain(first, 0.3)
        first.shutdown()
        second.shutdown()
    finally:
        core.shutdown()


def test_an_attached_frontend_leaving_keeps_the_core_and_the_owner_leaving_ends_it(
    config: EngineConfig,
) -> None:
    core = owner(config, extra=2)
    try:
        leaving, staying = attach(config, core, 1), attach(config, core, 2)
        leaving.add_request(request("g", max_tokens=2))
        assert tokens(collect(leaving, {"g"})["g"]) == [13, 14]
        leaving.shutdown()
        assert core.call_utility("is_healthy") is True
        core.add_request(request("o", max_tokens=2))
        staying.add_request(request("s", max_tokens=2))
        assert tokens(collect(core, {"o"})["o"]) == [13, 14]
        assert tokens(collect(staying, {"s"})["s"]) == [13, 14]
    finally:
        core.shutdown()
    deadline = time.monotonic() + 10
    while not staying.is_dead:
        assert time.monotonic() < deadline, "the attached frontend never saw the core go"
        time.sleep(0.05)
    with pytest.raises(EngineDeadError, match="shared EngineCore process .* is gone"):
        staying.add_request(request("late"))
    staying.shutdown()


def test_a_request_whose_client_index_is_out_of_range_goes_to_the_owner(
    config: EngineConfig,
) -> None:
    """A custom frontend's bad client_index cannot make an output vanish."""
    core = owner(config, extra=1)
    try:
        bad = EngineCoreRequest(
            request_id="x",
            prompt_token_ids=[5, 6, 7],
            sampling_params=request("x").sampling_params,
            client_index=7,
        )
        core.add_request(bad)
        assert tokens(collect(core, {"x"})["x"]) == [13, 14, 15, 16]
    finally:
        core.shutdown()
