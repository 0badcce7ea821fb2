"""Tensor parallelism: rank 0's worker in the EngineCore process, ranks 1..N-1 as worker
processes (`MultiprocExecutor`) or Ray actors (`v1.executor.ray`). Every call goes to the other
ranks first (msgspec over ZMQ), then runs on rank 0, so collectives inside the step meet. A
worker that exits makes the step raise WorkerDeadError (or the failure callback fire when idle);
every exit path of the core kills the workers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import zmq

from v1.config import EngineConfig
from v1.core.errors import WorkerDeadError
from v1.core.executor import Executor
from v1.core.sched_output import DeferredRunnerOutput, ModelRunnerOutput, SchedulerOutput
from v1.core.serial import MsgpackDecoder, MsgpackEncoder
from v1.executor.worker_proc import WorkerAddresses, WorkerMethod, WorkerReply
from v1.kv_cache.spec import KVCacheConfig, KVCacheSpec
from v1.logger import init_logger

logger = init_logger(__name__)

WATCH_INTERVAL_S = 0.05
"""How often the watcher checks the workers."""
DEATH_GRACE_S = 1.0
"""After a failed step, how long to wait for a worker's exit to show (the step's error is
then reported as the worker's death)."""
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_S = 2.0


class DistributedExecutor(Executor):
    """Rank 0 here, ranks >= 1 elsewhere; subclasses start and watch the others."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.tensor_parallel_size
        self.dead_error: str | None = None
        self._failure_callback: Callable[[str], None] | None = None
        self._closing = threading.Event()
        self.encoder = MsgpackEncoder()
        self.reply_decoder = MsgpackDecoder(WorkerReply)
        self.ctx = zmq.Context()
        self.reply_socket = self.ctx.socket(zmq.PULL)
        self.push_sockets: list[Any] = []
        self.worker: Any = None
        self.local_rank0: int | None = None
        """Rank 0's GPU index in this process (None: the rank, 0)."""
        try:
            addresses = self._bind_sockets()
            self._start_workers(addresses)
            self._watcher = threading.Thread(target=self._watch, name="TPWatch", daemon=True)
            self._watcher.start()
            self._start_local_worker()
        except BaseException:
            self.shutdown()
            raise

    # ---- subclass hooks ----
    @abstractmethod
    def _endpoint(self, name: str) -> str:
        """An address to bind for `name` (ipc in a private directory, or explicit tcp)."""

    @abstractmethod
    def _start_workers(self, addresses: list[WorkerAddresses]) -> None:
        """Start ranks 1..N-1 (addresses[r - 1] is rank r's)."""

    @abstractmethod
    def _exited_worker(self) -> str | None:
        """A description of a worker that is gone, or None while all run."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """Make sure no worker survives (after they were asked to shut down)."""

    @abstractmethod
    def distributed_init_method(self) -> str: ...

    # ---- start-up ----
    def _bind_sockets(self) -> list[WorkerAddresses]:
        reply_address = self._bind(self.reply_socket, "replies")
        addresses = []
        for rank in range(1, self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            self.push_sockets.append(sock)
            addresses.append(WorkerAddresses(self._bind(sock, f"rank{rank}"), reply_address))
        return addresses

    def _bind(self, sock: Any, name: str) -> str:
        """Binds `sock` to the endpoint for `name`; returns the address workers connect to."""
        address = self._endpoint(name)
        sock.bind(address)
        return address

    def _start_local_worker(self) -> None:
        """Rank 0 joins the group while the others do (in a thread, so that a worker dying
        during start-up is noticed instead of waiting on the rendezvous forever)."""
        from v1.worker.worker import Worker

        result: dict[str, Any] = {}

        def build() -> None:
            try:
                worker = Worker(self.config, 0, self.local_rank0, self.distributed_init_method())
                worker.load_model()
                result["worker"] = worker
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = e

        thread = threading.Thread(target=build, name="TPRank0Start", daemon=True)
        thread.start()
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while thread.is_alive() or len(ready) < self.world_size - 1:
            self._raise_if_dead("during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("tensor-parallel workers did not start in time")
            if "error" in result:
                break
            reply = self._recv_reply(timeout_ms=50)
            if reply is not None:
                if reply.error is not None:
                    raise RuntimeError(f"tensor-parallel rank {reply.rank} failed: {reply.error}")
                ready.add(reply.rank)
            thread.join(timeout=0)
        if "error" in result:
            raise result["error"]
        self.worker = result["worker"]
        self.worker.limit_cpu_threads()  # for this thread, which runs the steps

    # ---- messaging ----
    def _broadcast(self, method: WorkerMethod, payload: Any = None) -> None:
        self._raise_if_dead()
        frames = [] if payload is None else self.encoder.encode(payload)
        for sock in self.push_sockets:
            sock.send_multipart([method.value, *frames], copy=False)

    def _recv_reply(self, timeout_ms: int) -> WorkerReply | None:
        if not self.reply_socket.poll(timeout_ms):
            return None
        return self.reply_decoder.decode(self.reply_socket.recv_multipart(copy=False))

    def _gather(self, method: WorkerMethod) -> dict[int, Any]:
        """Every other rank's reply value to `method` (raises what a rank reported)."""
        values: dict[int, Any] = {}
        while len(values) < self.world_size - 1:
            self._raise_if_dead()
            reply = self._recv_reply(timeout_ms=50)
            if reply is None:
                continue
            if reply.error is not None:
                raise RuntimeError(f"tensor-parallel rank {reply.rank} failed: {reply.error}")
            assert reply.method == method.name, (reply.method, method.name)
            values[reply.rank] = reply.value
        return values

    def _raise_if_dead(self, when: str = "") -> None:
        gone = self.dead_error or self._exited_worker()
        if gone is not None:
            self.dead_error = gone
            raise WorkerDeadError(f"{gone}{' ' + when if when else ''}")

    def _dead_after(self, error: BaseException) -> WorkerDeadError | None:
        """A WorkerDeadError when a worker's exit explains `error` (it may take a moment to
        show: a collective fails as soon as the peer's socket closes)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            gone = self.dead_error or self._exited_worker()
            if gone is not None:
                self.dead_error = gone
                return WorkerDeadError(f"{gone} (the step failed: {type(error).__name__})")
            if time.monotonic() > deadline:
                return None
            time.sleep(WATCH_INTERVAL_S)

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            gone = self._exited_worker()
            if gone is None:
                continue
            if self._closing.is_set():
                return
            self.dead_error = gone
            logger.error("%s; the engine fails", gone)
            if self._failure_callback is not None:
                self._failure_callback(gone)
            return

    def set_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callback = callback

    # ---- Executor ----
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        # Every rank derives the same specs from the config (cross-attention mode included):
        # rank 0's answer holds for all, and INIT_KV_CACHE rebuilds them on each rank.
        return self._local(self.worker.get_kv_cache_specs)

    def determine_available_kv_bytes(self) -> int:
        self._broadcast(WorkerMethod.AVAILABLE_KV_BYTES)
        local = self._local(self.worker.determine_available_kv_bytes)
        return min([local, *self._gather(WorkerMethod.AVAILABLE_KV_BYTES).values()])

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._broadcast(WorkerMethod.INIT_KV_CACHE, kv_cache_config.num_blocks)
        self._local(self.worker.initialize_kv_cache, kv_cache_config)
        self._gather(WorkerMethod.INIT_KV_CACHE)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(WorkerMethod.EXECUTE, scheduler_output)
        return self._local(self.worker.execute_model, scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> DeferredRunnerOutput:
        self._broadcast(WorkerMethod.EXECUTE_ASYNC, scheduler_output)
        deferred = self._local(self.worker.execute_model_async, scheduler_output)
        return _WatchedDeferred(deferred, self)

    def _local(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            dead = self._dead_after(e)
            if dead is not None:
                raise dead from e
            raise

    def shutdown(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            if self.dead_error is None:
                for sock in self.push_sockets:
                    sock.send_multipart([WorkerMethod.SHUTDOWN.value], copy=False)
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            self._stop_workers()
            for sock in self.push_sockets:
                sock.close(linger=0)
            self.reply_socket.close(linger=0)
            self.ctx.term()


class _WatchedDeferred:
    """A launched step: reading it back makes the other ranks read theirs back too (steps are
    read back in launch order), and its failure is reported as a worker's death when one
    died."""

    def __init__(self, inner: DeferredRunnerOutput, executor: DistributedExecutor) -> None:
        self.inner = inner
        self.executor = executor

    def get_output(self) -> ModelRunnerOutput:
        self.executor._broadcast(WorkerMethod.READ_BACK)
        return self.executor._local(self.inner.get_output)


class MultiprocExecutor(DistributedExecutor):
    """Ranks 1..N-1 as `python -m v1.executor.worker_proc` processes on this machine,
    talking over ipc sockets in a private directory."""

    def __init__(self, config: EngineConfig) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="v1-tp-")
        self.procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self.ipc_dir)
        super().__init__(config)

    def _endpoint(self, name: str) -> str:
        return f"ipc://{self.ipc_dir}/{name}.sock"

    def distributed_init_method(self) -> str:
        return f"file://{self.ipc_dir}/rendezvous"

    def _start_workers(self, addresses: list[WorkerAddresses]) -> None:
        env = dict(os.environ)
        if self.config.device_config.device_type == "cpu":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo over loopback only
        config_line = (self.config.to_json() + "\n").encode()
        for rank, address in enumerate(addresses, start=1):
            cmd = [
                sys.executable,
                "-m",
                "v1.executor.worker_proc",
                f"--rank={rank}",
                f"--input={address.input}",
                f"--output={address.output}",
                f"--init-method={self.distributed_init_method()}",
                f"--parent-pid={os.getpid()}",
            ]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(config_line)
            proc.stdin.flush()  # stays open: its end-of-file tells the worker we are gone

    def _exited_worker(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                )
        return None

    def _stop_workers(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]


def _kill_all(procs: list[subprocess.Popen], ipc_dir: str) -> None:
    """Kill and reap every worker still running; remove the socket directory."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("tensor-parallel worker pid %d did not die", proc.pid)
        if proc.stdin is not None:
            proc.stdin.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)
