"""`SyncMPClient` (offline LLM) and `AsyncMPClient` (AsyncLLM, the server): the EngineCore as
its own program (`python -m PROGRAM`, never a fork: scripts need no `__main__` guard), over a
PUSH/PULL socket pair (`ipc://` in a private 0700 directory, or explicit TCP). A watcher turns
the core's death into `EngineDeadError` for every caller; the core removes the ipc directory if
the caller dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import zmq

from v1 import envs
from v1.config import EngineConfig
from v1.core.client import EngineCoreClient, HeldAdds
from v1.core.errors import EngineCoreStartError, EngineDeadError, UtilityCallError
from v1.core.process_handles import AttachedCore, CoreProcess, ForeignProcess
from v1.core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    ReadyMessage,
    UtilityOutput,
    UtilityRequest,
)
from v1.core.serial import DecodeError, MsgpackDecoder, MsgpackEncoder
from v1.logger import init_logger

logger = init_logger(__name__)

_POLL_MS = 100
"""Reader and sender wake-up period (bounds how long shutdown and death detection take)."""
_SENTINEL_GRACE_S = 0.3
"""After the process exits, how long to wait for its dead sentinel (it carries the error)."""


class _Dead:
    """Output-queue marker: the core is gone; waiters raise EngineDeadError."""


_DEAD = _Dead()


@dataclass
class _Resources:
    """Everything shutdown must release; kept apart from the client so that a finalizer can
    release it when the client is dropped without `shutdown()` (or at interpreter exit)."""

    ctx: zmq.Context
    input_socket: zmq.Socket
    output_socket: zmq.Socket
    ipc_dir: str | None
    proc: Any = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    proc_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held around every call that may reap the child (is_alive, join, exitcode): two threads
    reaping at once make the loser see ECHILD and report a live process with no exit code."""
    stop: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None


def _release(res: _Resources) -> None:
    """Stops the core (SHUTDOWN, then SIGTERM, then SIGKILL), the reader, the sockets and the
    ipc directory. Idempotent through weakref.finalize."""
    res.stop.set()
    proc = res.proc
    if proc is not None and proc.owned:
        with res.proc_lock:
            _stop_process(res, proc)
        proc.close_stdin()
    if res.reader is not None and res.reader is not threading.current_thread():
        res.reader.join(timeout=2)
    with res.send_lock:
        res.input_socket.close(linger=0)
    res.output_socket.close(linger=0)
    res.ctx.term()
    if res.ipc_dir is not None:
        shutil.rmtree(res.ipc_dir, ignore_errors=True)


def _stop_process(res: _Resources, proc: Any) -> None:
    """SHUTDOWN, then SIGTERM, then SIGKILL (caller holds proc_lock)."""
    if not proc.is_alive():
        return
    # No peer (zmq.Again: a core still starting has not connected): nothing to wait for, the
    # signals below still work.
    sent = False
    with res.send_lock, contextlib.suppress(zmq.ZMQError):
        res.input_socket.send(EngineCoreRequestType.SHUTDOWN.value, flags=zmq.NOBLOCK)
        sent = True
    if sent:
        proc.join(timeout=5)
    if proc.is_alive():
        logger.warning("EngineCore (pid %d) ignored SHUTDOWN; terminating it", proc.pid)
        proc.terminate()
        proc.join(timeout=3)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=3)


def _check_tcp_address(address: str) -> None:
    if not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"engine core addresses must be tcp:// or ipc://, got {address!r}")
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rpartition(":")[0]
        if host in ("", "*"):
            raise ValueError(f"bind an explicit host, not {address!r} (never '*')")


class MPClient(EngineCoreClient):
    """Starts the core process and owns the sockets; subclasses deliver outputs."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        program: str,
        input_address: str | None = None,
        output_address: str | None = None,
        executor_factory: str | None = None,
        ready_timeout_s: float | None = None,
        core_env: dict[str, str] | None = None,
        abort_start: threading.Event | None = None,
        extra_frontends: int = 0,
        attach: AttachedCore | None = None,
    ) -> None:
        """`program`: the module run as the core process (`python -m program`; it picks the
        executor and calls `v1.core.engine_core_proc.run_engine_core`). `input_address`/`output_address`: explicit endpoints to bind (both or neither; e.g.
        tcp://127.0.0.1:5555); default ipc:// in a private temp dir. `executor_factory`: an
        import path `module:Name` the core builds its executor with (tests). `core_env`:
        environment variables set for the core process only (a data-parallel core's devices).
        `abort_start`: set by another thread to give up waiting for the handshake (the core is
        stopped and EngineCoreStartError raised), e.g. when the frontend built meanwhile failed.
        `extra_frontends`: the core also serves this many other frontends (API server
        processes), each on an ipc pair named in `frontend_addresses` that it binds itself.
        `attach`: share a core another client started instead of starting one."""
        if extra_frontends and (attach is not None or input_address is not None):
            raise ValueError("extra_frontends needs a core of its own on ipc:// addresses")
        self.config = config
        self.client_index = attach.client_index if attach is not None else 0
        self.frontend_addresses: list[tuple[str, str]] = []
        """(input, output) of each extra frontend, client_index 1, 2, ..."""
        self._core_env = core_env
        self._program = program
        self._lock = threading.Lock()
        self._dead_error: str | None = None
        self._closing = False
        self._utility_futures: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self._encoder = MsgpackEncoder()
        if attach is not None:
            input_address, output_address = attach.input_address, attach.output_address
        self._res = self._bind(input_address, output_address)
        self._finalizer = weakref.finalize(self, _release, self._res)
        if self._res.ipc_dir is not None:
            self.frontend_addresses = [
                (
                    f"ipc://{self._res.ipc_dir}/input-{i}.sock",
                    f"ipc://{self._res.ipc_dir}/output-{i}.sock",
                )
                for i in range(1, extra_frontends + 1)
            ]
        try:
            if attach is not None:
                self._res.proc = ForeignProcess(attach.pid)
            else:
                self._start_process(executor_factory)
            ready = self._wait_ready(
                envs.V1_ENGINE_READY_TIMEOUT_S if ready_timeout_s is None else ready_timeout_s,
                abort_start,
            )
        except BaseException:
            self._closing = True
            self._finalizer()
            raise
        self.num_kv_blocks = ready.num_kv_blocks
        self.max_model_len = ready.max_model_len
        self._res.reader = threading.Thread(
            target=self._reader_loop, name="EngineCoreClientReader", daemon=True
        )
        self._res.reader.start()
        threading.Thread(target=self._watch_process, name="EngineCoreWatcher", daemon=True).start()

    # ---- start-up ----
    def _bind(self, input_address: str | None, output_address: str | None) -> _Resources:
        if (input_address is None) != (output_address is None):
            raise ValueError("give both input_address and output_address, or neither")
        ipc_dir = None
        if input_address is None or output_address is None:
            ipc_dir = tempfile.mkdtemp(prefix="v1-engine-")  # mode 0700
            input_address = f"ipc://{ipc_dir}/input.sock"
            output_address = f"ipc://{ipc_dir}/output.sock"
        else:
            _check_tcp_address(input_address)
            _check_tcp_address(output_address)
        ctx = zmq.Context()
        input_socket = ctx.socket(zmq.PUSH)
        input_socket.setsockopt(zmq.SNDHWM, 0)
        output_socket = ctx.socket(zmq.PULL)
        output_socket.setsockopt(zmq.RCVHWM, 0)
        try:
            input_socket.bind(input_address)
            output_socket.bind(output_address)
        except zmq.ZMQError:
            input_socket.close(linger=0)
            output_socket.close(linger=0)
            ctx.term()
            if ipc_dir is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        self.input_address, self.output_address = input_address, output_address
        return _Resources(ctx, input_socket, output_socket, ipc_dir)

    def _start_process(self, executor_factory: str | None) -> None:
        args = ["--config", "-", "--input", self.input_address, "--output", self.output_address]
        args += ["--parent-pid", str(os.getpid()), "--watch-stdin"]
        if executor_factory is not None:
            args += ["--executor-factory", executor_factory]
        if self._res.ipc_dir is not None:
            args += ["--ipc-dir", self._res.ipc_dir]
        for input_address, output_address in self.frontend_addresses:
            args += ["--frontend", input_address, output_address]
        self._res.proc = CoreProcess(self._program, args, self.config.to_json(), self._core_env)

    def _wait_ready(self, timeout_s: float, abort: threading.Event | None = None) -> ReadyMessage:
        decoder = MsgpackDecoder(ReadyMessage)
        sock, proc = self._res.output_socket, self._res.proc
        deadline = time.monotonic() + timeout_s
        while True:
            if abort is not None and abort.is_set():
                raise EngineCoreStartError("the EngineCore start-up was aborted by its frontend")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the EngineCore was not ready after {timeout_s:.0f}s "
                    "(V1_ENGINE_READY_TIMEOUT_S)"
                )
            if sock.poll(min(remaining, 0.1) * 1000):
                try:
                    ready = decoder.decode(sock.recv_multipart(copy=False))
                except DecodeError as e:
                    logger.error("ignored a malformed handshake message: %s", e)
                    continue
                if ready.status != "READY":
                    raise EngineCoreStartError(f"the EngineCore failed to start: {ready.error}")
                return ready
            if not proc.is_alive() and not sock.poll(200):
                raise EngineCoreStartError(
                    f"the EngineCore process exited with code {proc.exitcode} before it was ready"
                )

    # ---- background threads ----
    def _reader_loop(self) -> None:
        try:
            self._read_outputs()
        except Exception as e:  # noqa: BLE001 - nobody would read outputs: fail every caller
            if not self._res.stop.is_set():
                logger.exception("the EngineCore client's reader failed")
                self._set_dead(f"the client's output reader failed: {type(e).__name__}: {e}")

    def _read_outputs(self) -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        sock, stop = self._res.output_socket, self._res.stop
        while not stop.is_set():
            if not sock.poll(_POLL_MS):
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                outputs = decoder.decode(frames)
            except DecodeError as e:
                logger.error("dropped a malformed message from the EngineCore: %s", e)
                continue
            if outputs.utility_output is not None:
                self._resolve_utility(outputs.utility_output)
            if outputs.engine_dead:
                self._set_dead(f"the EngineCore died: {outputs.error}")
                return
            if outputs.outputs:
                self._deliver(outputs)

    def _watch_process(self) -> None:
        proc = self._res.proc
        proc.wait_exit()
        if self._closing or self._res.stop.is_set():
            return  # shut down (or released at interpreter exit): not a death
        deadline = time.monotonic() + _SENTINEL_GRACE_S
        while self._dead_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not proc.owned:  # its exit code is its starter's to read
            self._set_dead(f"the shared EngineCore process (pid {proc.pid}) is gone")
            return
        code = self.wait_for_exit(timeout=_SENTINEL_GRACE_S)
        self._set_dead(f"the EngineCore process (pid {proc.pid}) exited with code {code}")

    def _set_dead(self, message: str) -> None:
        with self._lock:
            if self._dead_error is not None:
                return
            self._dead_error = message
            futures = list(self._utility_futures.values())
            self._utility_futures.clear()
        if not self._closing and not self._res.stop.is_set():
            logger.error("%s; failing every pending request", message)
        for fut in futures:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._deliver(_DEAD)

    def _resolve_utility(self, out: UtilityOutput) -> None:
        with self._lock:
            fut = self._utility_futures.pop(out.call_id, None)
        if fut is None:
            logger.warning("utility result for unknown call %d", out.call_id)
        elif out.failure_message is not None:
            fut.set_exception(UtilityCallError(out.failure_message))
        else:
            fut.set_result(out.result)

    def _deliver(self, item: EngineCoreOutputs | _Dead) -> None:
        raise NotImplementedError

    # ---- sending ----
    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.client_index:  # a shared core routes the outputs back by it
            if kind is EngineCoreRequestType.ADD:
                payload.client_index = self.client_index
            elif kind is EngineCoreRequestType.ADD_MANY:
                for request in payload:
                    request.client_index = self.client_index
        with self._res.send_lock:
            self._send_frames_locked([kind.value, *self._encoder.encode(payload)])

    def send_adds(self, requests: list[EngineCoreRequest]) -> None:
        """`requests` in one message (ADD for a single one)."""
        if len(requests) == 1:
            self._send(EngineCoreRequestType.ADD, requests[0])
        elif requests:
            self._send(EngineCoreRequestType.ADD_MANY, requests)

    def _send_frames_locked(self, frames: list[Any]) -> None:
        """Sends one multipart message (caller holds send_lock); waits only while no core is
        connected, and raises EngineDeadError once the core is gone."""
        res = self._res
        while True:
            self._check_alive()
            try:
                res.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                res.input_socket.poll(_POLL_MS, zmq.POLLOUT)  # no core connected (yet)

    def _start_utility(self, method: str, args: Sequence[Any]) -> Future:
        fut: Future = Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._utility_futures[call_id] = fut
        try:
            call = UtilityRequest(call_id, method, list(args), self.client_index)
            self._send(EngineCoreRequestType.UTILITY, call)
        except BaseException:
            with self._lock:
                self._utility_futures.pop(call_id, None)
            raise
        return fut

    # ---- shared API ----
    @property
    def is_dead(self) -> bool:
        """The core is gone (died or shut down): every call raises EngineDeadError."""
        return self._dead_error is not None

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    @property
    def pid(self) -> int:
        return self._res.proc.pid

    def wait_for_exit(self, timeout: float | None = None) -> int | None:
        """Waits up to `timeout` seconds for the core process to exit; its exit code, or None
        while it still runs. Safe beside the client's own watcher (one thread reaps at a time)."""
        with self._res.proc_lock:
            self._res.proc.join(timeout)
            return self._res.proc.exitcode

    def shutdown(self) -> None:
        """Stops the core and releases everything; pending and later calls raise
        EngineDeadError. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._set_dead("the EngineCore client was shut down")
        self._finalizer()


class BlockingOutputQueue:
    """Outputs handed from a client's reader threads to blocking `get_output` calls, from any
    thread. The host class sets `_dead_error` (str or None) and has `_check_alive`."""

    _dead_error: str | None
    _check_alive: Callable[[], None]

    def _init_blocking_queue(self) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | _Dead] = queue.Queue()

    def _deliver(self, item: EngineCoreOutputs | _Dead) -> None:
        self._outputs.put(item)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next EngineCoreOutputs; TimeoutError after `timeout` seconds if given;
        EngineDeadError (for every waiter) once the death marker came."""
        self._check_alive()
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no EngineCore output within {timeout}s") from None
        if isinstance(item, _Dead):
            self._outputs.put(item)  # wake the next waiter too
            raise EngineDeadError(self._dead_error)
        return item


class SyncMPClient(BlockingOutputQueue, MPClient):
    """Blocking client: `add_request` / `abort_requests` / `get_output` / `call_utility`,
    safe to call from several threads."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self._init_blocking_queue()
        self._held = HeldAdds(list, self.send_adds)
        super().__init__(config, **kwargs)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self._held.requests is not None:
            self._held.requests.append(request)
        else:
            self._send(EngineCoreRequestType.ADD, request)

    def batched_adds(self) -> AbstractContextManager[None]:
        """See `EngineCoreClient.batched_adds`: the held requests go out as one ADD_MANY."""
        return self._held.block()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._held.flush()
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        self._held.flush()
        return self._start_utility(method, args).result()


class LoopOutputQueue:
    """Outputs handed from a client's reader threads to the asyncio loop that awaits them. It
    serves one event loop at a time (it moves to a new loop once the previous one is closed,
    e.g. across `asyncio.run` calls); outputs that arrive before a loop awaits are kept.
    The host class sets `_dead_error` (str or None)."""

    _dead_error: str | None

    def _init_loop_queue(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | _Dead] | None = None
        self._early: deque[EngineCoreOutputs | _Dead] = deque()
        self._loop_lock = threading.Lock()

    def _deliver(self, item: EngineCoreOutputs | _Dead) -> None:
        with self._loop_lock:
            if self._loop is None or self._queue is None:
                self._early.append(item)
                return
            loop, q = self._loop, self._queue
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop closed under us; the next loop starts afresh
            with self._loop_lock:
                self._early.append(item)

    def _output_queue(self) -> asyncio.Queue[EngineCoreOutputs | _Dead]:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._queue is not None:
            return self._queue
        with self._loop_lock:
            if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
                raise RuntimeError(
                    f"this {type(self).__name__} is in use by another running event loop"
                )
            self._queue = asyncio.Queue()
            while self._early:
                self._queue.put_nowait(self._early.popleft())
            if self._dead_error is not None:
                self._queue.put_nowait(_DEAD)
            self._loop = loop
            return self._queue

    async def _next_output(self) -> EngineCoreOutputs:
        """The next outputs; EngineDeadError (for every waiter) once the death marker came."""
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        q = self._output_queue()
        item = await q.get()
        if isinstance(item, _Dead):
            q.put_nowait(item)  # wake the next waiter too
            raise EngineDeadError(self._dead_error)
        return item


class AsyncMPClient(LoopOutputQueue, MPClient):
    """asyncio client: the `*_async` methods, outputs through a `LoopOutputQueue`."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self._init_loop_queue()
        super().__init__(config, **kwargs)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """`abort_requests_async` without awaiting: for `finally` blocks of cancelled or
        closed iterators, which must not await."""
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._next_output()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._start_utility(method, args))


__all__ = [
    "AsyncMPClient",
    "CoreProcess",
    "EngineCoreStartError",
    "LoopOutputQueue",
    "MPClient",
    "SyncMPClient",
    "UtilityCallError",
]
