"""The EngineCore process driven through SyncMPClient with a scripted executor (no model):
handshake, requests, utilities, malformed input, eager aborts, and every way of dying."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from v1.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from v1.core.errors import EngineCoreStartError, EngineDeadError, UtilityCallError
from v1.core.executor import Executor
from v1.core.mp_client import SyncMPClient
from v1.core.protocol import EngineCoreRequest, EngineCoreRequestType, FinishReason
from v1.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1.engine.core_client import CORE_PROGRAM
from v1.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

# Prompts starting with these tokens script the executor's behaviour.
SLOW, DIE, HANG = 90, 91, 92
STEP_SLEEP_S = 1.0
REPO_ROOT = Path(__file__).resolve().parents[2]


class CoreDeath(BaseException):
    """Escapes EngineCore's per-step error handling, like a real engine bug would."""


class ScriptedExecutor(Executor):
    """One FullAttention layer; token i of a request is 10 + (prompt_len + i) % 50. Requests
    whose prompt starts with SLOW make their steps take STEP_SLEEP_S, DIE kills the core, HANG
    blocks the step; pooling requests return [num_tokens] * 4 as float32."""

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.cache_config.block_size
        self.marker: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.pooling: set[str] = set()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {"layers.0.self_attn": FullAttentionSpec(self.block_size, 1, 8, "float32")}

    def determine_available_kv_bytes(self) -> int:
        return 1 << 20

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            for table in (self.marker, self.num_tokens, self.computed):
                table.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.marker[new.req_id] = new.prompt_token_ids[0]
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        req_ids = list(so.num_scheduled_tokens)
        markers = {self.marker[r] for r in req_ids}
        if DIE in markers:
            raise CoreDeath("scripted engine bug")
        if HANG in markers:
            time.sleep(3600)
        if SLOW in markers:
            time.sleep(STEP_SLEEP_S)
        sampled: list[list[int]] = []
        pooled: list[Any] = []
        for req_id in req_ids:
            self.computed[req_id] += so.num_scheduled_tokens[req_id]
            if req_id in self.pooling:
                sampled.append([])
                pooled.append(np.full(4, self.computed[req_id], dtype=np.float32))
            elif self.computed[req_id] == self.num_tokens[req_id]:
                sampled.append([10 + self.num_tokens[req_id] % 50])
                self.num_tokens[req_id] += 1
                pooled.append(None)
            else:
                sampled.append([])
                pooled.append(None)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, pooler_output=pooled)


class FailingExecutor(ScriptedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        raise ValueError("no weights in this folder")


def factory_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def scripted_config(model_dir: str) -> EngineConfig:
    """The scripted executor loads no weights: only the model's config.json is read."""
    return EngineConfig(
        model_config=ModelConfig(model=model_dir),
        cache_config=CacheConfig(block_size=4, num_kv_blocks=128),
        scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256),
    )


@pytest.fixture(scope="module")
def config(tiny_llama_dir: str) -> EngineConfig:
    return scripted_config(tiny_llama_dir)


def start_client(config: EngineConfig, **kwargs: Any) -> SyncMPClient:
    return SyncMPClient(
        config, program=CORE_PROGRAM, executor_factory=factory_path(ScriptedExecutor), **kwargs
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FRONTEND = textwrap.dedent(
    """
    import sys, time
    from v1.config import EngineConfig
    from v1.core.mp_client import SyncMPClient
    from v1.engine.core_client import CORE_PROGRAM

    # No __main__ guard: the core is its own program and does not import this script.
    config = EngineConfig.from_json(sys.stdin.read())
    client = SyncMPClient(config, program=CORE_PROGRAM, executor_factory=sys.argv[1])
    print(client.pid, client._res.ipc_dir, flush=True)
    time.sleep(600)
    """
)


def start_frontend(config: EngineConfig, tmp_dir: Path) -> subprocess.Popen:
    """A frontend in its own process that starts a core and prints the core's pid."""
    script = tmp_dir / "frontend.py"
    script.write_text(FRONTEND)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), str(REPO_ROOT), env.get("PYTHONPATH", "")]
    )
    frontend = subprocess.Popen(
        [sys.executable, str(script), factory_path(ScriptedExecutor)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    frontend.stdin.write(config.to_json())
    frontend.stdin.close()
    return frontend


@pytest.fixture(scope="module")
def cores(config: EngineConfig, tmp_path_factory: pytest.TempPathFactory):
    """Every core process this module needs, started at once (start-up is mostly imports, so
    starting them side by side saves most of the wall time)."""
    frontend = start_frontend(config, tmp_path_factory.mktemp("frontend"))
    tcp = {
        "input_address": f"tcp://127.0.0.1:{free_port()}",
        "output_address": f"tcp://127.0.0.1:{free_port()}",
    }
    with ThreadPoolExecutor(4) as pool:
        futures = {
            "client": pool.submit(start_client, config),
            "victim": pool.submit(start_client, config),
            "tcp": pool.submit(start_client, config, **tcp),
            "failing": pool.submit(
                SyncMPClient,
                config,
                program=CORE_PROGRAM,
                executor_factory=factory_path(FailingExecutor),
            ),
        }
        wait_futures(futures.values())
    started: dict[str, Any] = {"frontend": frontend}
    for name, fut in futures.items():
        started[name] = fut.exception() if name == "failing" else fut.result()
    yield started
    for value in started.values():
        if isinstance(value, SyncMPClient):
            value.shutdown()
    if frontend.poll() is None:
        frontend.kill()
        frontend.wait()


@pytest.fixture
def client(cores: dict[str, Any], config: EngineConfig) -> SyncMPClient:
    """A live client shared by the tests of this module (restarted if a test killed it)."""
    if cores["client"].is_dead:
        cores["client"].shutdown()
        cores["client"] = start_client(config)
    return cores["client"]


def request(req_id: str, max_tokens: int = 4, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=prompt or [5, 6, 7],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def collect(client: SyncMPClient, req_ids: set[str], timeout: float = 30.0) -> dict[str, list]:
    """Outputs per request until every one in `req_ids` has finished."""
    got: dict[str, list] = {r: [] for r in req_ids}
    pending = set(req_ids)
    deadline = time.monotonic() + timeout
    while pending:
        outs = client.get_output(timeout=max(deadline - time.monotonic(), 0.01))
        for o in outs.outputs:
            got.setdefault(o.request_id, []).append(o)
            if o.finished:
                pending.discard(o.request_id)
    return got


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def wait_until(cond, timeout: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_requests_stream_and_finish(client: SyncMPClient):
    assert client.num_kv_blocks == 128 and client.max_model_len == 256
    client.add_request(request("a", max_tokens=3))
    client.add_request(request("b", max_tokens=6, prompt=[1] * 9))
    got = collect(client, {"a", "b"})
    assert tokens(got["a"]) == [13, 14, 15]
    assert tokens(got["b"]) == [10 + n % 50 for n in range(9, 15)]
    assert got["b"][-1].finish_reason == FinishReason.LENGTH
    stats = client.call_utility("get_stats")
    assert stats["num_requests"] == 0 and stats["num_kv_requests"] == 0


def test_pooled_arrays_come_back_as_arrays(client: SyncMPClient):
    client.add_request(
        EngineCoreRequest(request_id="p", prompt_token_ids=[3] * 5, pooling_params=PoolingParams())
    )
    out = collect(client, {"p"})["p"][-1]
    assert isinstance(out.pooled_output, np.ndarray) and out.pooled_output.dtype == np.float32
    np.testing.assert_array_equal(out.pooled_output, np.full(4, 5.0, dtype=np.float32))


def test_utility_calls(client: SyncMPClient):
    info = client.call_utility("get_config_info")
    assert info == {"num_kv_blocks": 128, "block_size": 4, "max_model_len": 256}
    assert client.call_utility("is_healthy") is True
    with pytest.raises(UtilityCallError, match="unknown utility method 'nope'"):
        client.call_utility("nope")
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(client.call_utility("is_healthy")))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [True] * 8


def test_bad_requests_fail_alone(client: SyncMPClient):
    # a slow first step: the copy arrives while the original still runs
    client.add_request(request("dup", max_tokens=2, prompt=[SLOW, 1]))
    client.add_request(request("dup", max_tokens=2))
    client.add_request(
        EngineCoreRequest(request_id="empty", prompt_token_ids=[], sampling_params=SamplingParams())
    )
    outs: list = []
    while sum(o.finished for o in outs) < 3:  # dup twice (error + length), empty once
        outs += client.get_output(timeout=30).outputs
    empty = [o for o in outs if o.request_id == "empty"]
    assert len(empty) == 1 and empty[0].finish_reason == FinishReason.ERROR
    dup = [o for o in outs if o.request_id == "dup"]
    errors = [o.error for o in dup if o.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "already in use" in errors[0]
    assert len(tokens(dup)) == 2  # the first one runs to its end


def test_batched_adds_go_out_as_one_message_in_call_order(client: SyncMPClient, monkeypatch):
    kinds: list[EngineCoreRequestType] = []
    send = client._send
    monkeypatch.setattr(
        client, "_send", lambda kind, payload: (kinds.append(kind), send(kind, payload))
    )
    with client.batched_adds():
        client.add_request(request("m1", max_tokens=3))
        with client.batched_adds():  # nested: the outer block sends
            client.add_request(request("m2", max_tokens=2, prompt=[1] * 9))
        client.add_request(request("m3", max_tokens=1))
        assert kinds == []  # held until the block ends
    assert kinds == [EngineCoreRequestType.ADD_MANY]
    got = collect(client, {"m1", "m2", "m3"})
    assert tokens(got["m1"]) == [13, 14, 15] and tokens(got["m2"]) == [19, 20]
    assert tokens(got["m3"]) == [13]
    with client.batched_adds():  # one held request: a plain ADD
        client.add_request(request("m4", max_tokens=1))
    assert kinds[-1] == EngineCoreRequestType.ADD and tokens(collect(client, {"m4"})["m4"]) == [13]
    with pytest.raises(RuntimeError, match="boom"), client.batched_adds():
        client.add_request(request("m5", max_tokens=1))
        raise RuntimeError("boom")  # what was added still goes out (the caller aborts it)
    assert tokens(collect(client, {"m5"})["m5"]) == [13]
    # An abort inside the block goes after the adds held before it: "m6" never runs.
    with client.batched_adds():
        client.add_request(request("m6", max_tokens=50, prompt=[SLOW, 1]))
        client.abort_requests(["m6"])
        client.add_request(request("m7", max_tokens=2))
    assert kinds[-3:] == [
        EngineCoreRequestType.ADD,
        EngineCoreRequestType.ABORT,
        EngineCoreRequestType.ADD,
    ]
    got = collect(client, {"m7"})
    assert tokens(got["m7"]) == [13, 14] and "m6" not in got
    assert client.call_utility("get_stats")["num_requests"] == 0


def send_raw(client: SyncMPClient, frames: list[bytes]) -> None:
    with client._res.send_lock:
        client._send_frames_locked(frames)


def test_malformed_frames_are_dropped_and_the_core_keeps_running(client: SyncMPClient):
    add = EngineCoreRequestType.ADD.value
    bad_array = msgspec.msgpack.encode(
        {
            "request_id": "badarr",
            "prompt_token_ids": [1],
            "encoder_input": {
                "num_encoder_tokens": 1,
                "content_hash": "h",
                "audio": msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["<f4", [4], 1])),
            },
        }
    )
    for frames in (
        [b"\x7f", b"junk"],  # unknown message type
        [b"\x00\x00", b"junk"],  # type frame of the wrong size
        [add, b"\xc1\xc1\xc1"],  # not msgpack
        [add],  # no payload
        [add, msgspec.msgpack.encode([1, 2, 3])],  # wrong shape
        [
            add,
            msgspec.msgpack.encode(
                {"request_id": "badreq", "prompt_token_ids": [1], "priority": "x"}
            ),
        ],
        [add, msgspec.msgpack.encode({"request_id": "badids", "prompt_token_ids": "x"})],
        [add, bad_array],  # array frame missing
        [
            EngineCoreRequestType.ADD_MANY.value,  # one bad request fails the whole message
            msgspec.msgpack.encode(
                [
                    {"request_id": "many-bad", "prompt_token_ids": [1], "priority": "x"},
                    msgspec.msgpack.decode(
                        msgspec.msgpack.encode({"request_id": "many-ok", "prompt_token_ids": [1]})
                    ),
                ]
            ),
        ],
        [EngineCoreRequestType.ABORT.value, msgspec.msgpack.encode([1, 2])],
        [EngineCoreRequestType.UTILITY.value, msgspec.msgpack.encode({"x": 1})],
    ):
        send_raw(client, frames)
    client.add_request(request("after-garbage", max_tokens=3))
    got = collect(client, {"after-garbage", "badreq", "badids", "badarr", "many-bad", "many-ok"})
    for req_id in ("many-bad", "many-ok"):
        assert got[req_id][-1].finish_reason == FinishReason.ERROR
        assert "malformed" in got[req_id][-1].error
    # undecodable requests whose id is readable get an error instead of silence
    assert got["badreq"][-1].finish_reason == FinishReason.ERROR
    assert "malformed" in got["badreq"][-1].error
    assert "refers to frame 1" in got["badarr"][-1].error
    # prompt ids are typed loosely on the wire (lists, or arrays for packed inputs): the core's
    # admission names a wrong type
    assert "prompt_token_ids must be a list of ints, got str" in got["badids"][-1].error
    assert len(tokens(got["after-garbage"])) == 3
    assert client.wait_for_exit(timeout=0) is None and client.call_utility("is_healthy")


def test_abort_during_a_step_takes_effect_before_its_outputs(client: SyncMPClient):
    client.add_request(request("slow", max_tokens=50, prompt=[SLOW, 1, 2]))
    first = client.get_output(timeout=10 * STEP_SLEEP_S)
    assert [o.request_id for o in first.outputs] == ["slow"]
    t0 = time.monotonic()
    client.abort_requests(["slow"])  # lands while the next (slow) step runs
    with pytest.raises(TimeoutError):
        client.get_output(timeout=2.5 * STEP_SLEEP_S)  # that step's token is never sent
    assert time.monotonic() - t0 >= 2 * STEP_SLEEP_S
    assert client.call_utility("get_stats")["num_requests"] == 0
    # the id can be reused at once
    client.add_request(request("slow", max_tokens=2))
    assert len(tokens(collect(client, {"slow"})["slow"])) == 2


def test_abort_and_readd_in_one_burst_keeps_order(client: SyncMPClient):
    for _ in range(3):  # tokens 30..49: never those of the last x
        client.add_request(request("x", max_tokens=20, prompt=[1] * 20))
        client.abort_requests(["x"])
    client.add_request(request("x", max_tokens=3, prompt=[1] * 7))  # tokens 17, 18, 19
    # An earlier x may still finish if its abort lands late, but no abort may hit the last one.
    last: list = []
    while not (last and last[-1].finished):
        outs = client.get_output(timeout=30).outputs
        last += [o for o in outs if o.request_id == "x" and set(o.new_token_ids) <= {17, 18, 19}]
    assert tokens(last) == [17, 18, 19] and last[-1].finish_reason == FinishReason.LENGTH
    assert client.call_utility("get_stats")["num_requests"] == 0


def test_ipc_dir_is_private(client: SyncMPClient):
    ipc_dir = client._res.ipc_dir
    assert client.input_address.startswith(f"ipc://{ipc_dir}/")
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700


@pytest.mark.parametrize("address", ["tcp://*:5555", "tcp://:5555", "udp://127.0.0.1:1"])
def test_wildcard_or_unknown_addresses_are_refused(config: EngineConfig, address: str):
    with pytest.raises(ValueError):
        start_client(config, input_address=address, output_address="tcp://127.0.0.1:5556")


def test_sigterm_shuts_the_core_down_gracefully(client: SyncMPClient):
    os.kill(client.pid, signal.SIGTERM)
    assert client.wait_for_exit(timeout=10) == 0
    wait_until(lambda: client.is_dead, timeout=2)
    with pytest.raises(EngineDeadError, match="exited with code 0"):
        client.get_output()


def test_failed_start_raises_a_clear_error(cores: dict[str, Any]):
    error = cores["failing"]
    assert isinstance(error, EngineCoreStartError)
    assert "ValueError: no weights in this folder" in str(error)


def test_fatal_error_sends_the_dead_sentinel_over_tcp(cores: dict[str, Any]):
    c = cores["tcp"]
    assert c.input_address.startswith("tcp://127.0.0.1:")
    try:
        c.add_request(request("ok", max_tokens=2))
        assert len(tokens(collect(c, {"ok"})["ok"])) == 2
        c.add_request(request("boom", prompt=[DIE]))
        with pytest.raises(EngineDeadError, match="CoreDeath: scripted engine bug"):
            collect(c, {"boom"})
        # generous: CI shares 2 cores with other test processes
        assert c.wait_for_exit(timeout=30) == 1
        with pytest.raises(EngineDeadError):
            c.add_request(request("later"))
    finally:
        c.shutdown()


def test_sigkill_fails_every_pending_call_fast(cores: dict[str, Any]):
    c = cores["victim"]
    ipc_dir = c._res.ipc_dir
    try:
        c.add_request(request("stuck", prompt=[HANG]))
        time.sleep(1.0)  # the core takes it and hangs in its first step: calls now stay pending
        errors: dict[str, float] = {}

        def pending(name: str, fn) -> None:
            try:
                fn()
            except EngineDeadError:
                errors[name] = time.monotonic()

        threads = [
            threading.Thread(target=pending, args=("get_output", c.get_output)),
            threading.Thread(target=pending, args=("utility", lambda: c.call_utility("get_stats"))),
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both are blocked: the core is stuck in a step
        assert not errors
        killed_at = time.monotonic()
        os.kill(c.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=5)
        assert set(errors) == {"get_output", "utility"}
        assert max(errors.values()) - killed_at < 2.0
        for call in (
            c.get_output,
            lambda: c.add_request(request("new")),
            lambda: c.call_utility("get_stats"),
            lambda: c.abort_requests(["x"]),
        ):
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="exited with code -9"):
                call()
            # "at once": no waiting on the dead core (the slack is for loaded CI machines)
            assert time.monotonic() - t0 < 0.5
    finally:
        c.shutdown()
        c.shutdown()  # idempotent
    assert not os.path.exists(ipc_dir)


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_core_exits_when_its_frontend_is_killed(cores: dict[str, Any]):
    frontend = cores["frontend"]
    line = frontend.stdout.readline()
    assert line.split()[:1] and line.split()[0].isdigit(), f"the frontend failed: {line!r}"
    core_pid, ipc_dir = int(line.split()[0]), line.split()[1]
    try:
        assert not _pid_gone(core_pid) and os.path.isdir(ipc_dir)
        frontend.kill()
        frontend.wait(timeout=10)
        elapsed = wait_until(lambda: _pid_gone(core_pid), timeout=10)
        assert elapsed < 5.0
        assert not os.path.exists(ipc_dir)  # the core removed it: nobody else would
    finally:
        if not _pid_gone(core_pid):
            os.kill(core_pid, signal.SIGKILL)
