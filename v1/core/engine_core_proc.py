"""EngineCoreProc: the EngineCore in its own process, talking ZMQ + msgspec (docs/protocol.md).
An input thread decodes messages, a busy loop applies them in order and steps the core, an
output thread encodes and sends; the process answers the handshake, sends the dead sentinel on a
fatal error and exits when its frontend dies. Its program (`python -m v1.engine.core_process`)
picks the executor and hands it in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from v1.config import EngineConfig
from v1.core.encoder_inputs import with_content_hash
from v1.core.engine_core import EngineCore
from v1.core.executor import ExecutorFactory
from v1.core.protocol import (
    EncoderInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    ReadyMessage,
    UtilityOutput,
    UtilityRequest,
    now,
)
from v1.core.serial import DecodeError, MsgpackDecoder, MsgpackEncoder
from v1.gc_policy import raise_full_collection_threshold
from v1.logger import init_logger

logger = init_logger(__name__)

PARENT_POLL_S = 1.0
"""How often the parent-death watch checks (the core exits within ~2x this of its frontend)."""
STUCK_STEP_S = 5.0
"""How long the busy loop may stay in a step after a worker died before the process exits."""


@dataclass(frozen=True)
class CoreAddresses:
    """ZMQ endpoints the frontend bound; the core connects to both. A core shared by several
    frontends (API server processes) gets one pair each: `extra_frontends`, frontend 1 on."""

    input: str
    """Frontend PUSH -> core PULL: requests, aborts, utility calls, shutdown."""
    output: str
    """Core PUSH -> frontend PULL: the ready handshake, then EngineCoreOutputs."""
    extra_frontends: tuple[tuple[str, str], ...] = ()
    """(input, output) of frontends 1, 2, ...: one PULL socket takes every frontend's input
    (fair-queued); each output goes to the frontend whose `client_index` sent the request."""

    @property
    def outputs(self) -> list[str]:
        return [self.output, *(out for _, out in self.extra_frontends)]


class _Shutdown:
    """Input-queue marker: leave the busy loop."""


class _Fatal:
    """Input-queue marker: an I/O thread failed; the busy loop dies loudly."""

    def __init__(self, error: str) -> None:
        self.error = error


_SHUTDOWN = _Shutdown()


class EngineCoreProc:
    """Owns the sockets, the two I/O threads and the busy loop around one EngineCore."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: CoreAddresses,
        executor_factory: ExecutorFactory,
    ) -> None:
        self.zmq_ctx = zmq.Context()
        self.input_socket = self.zmq_ctx.socket(zmq.PULL)
        self.input_socket.connect(addresses.input)
        for input_address, _ in addresses.extra_frontends:
            self.input_socket.connect(input_address)
        self.output_sockets: list[zmq.Socket] = []
        """One per frontend, in client_index order."""
        for output_address in addresses.outputs:
            sock = self.zmq_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)  # flush the dead sentinel on exit
            sock.connect(output_address)
            self.output_sockets.append(sock)
        self.router = OutputRouter(len(self.output_sockets))
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        # Aborts the input thread saw, tagged with their sequence number (see _apply_eager_aborts).
        self._abort_lock = threading.Lock()
        self._eager_aborts: list[tuple[int, list[str]]] = []
        self._last_seq = 0
        self.stopping = threading.Event()
        self.input_thread = threading.Thread(
            target=self._input_loop, name="EngineCoreInput", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._output_loop, name="EngineCoreOutput", daemon=True
        )
        try:
            self.engine_core = EngineCore(config, executor_factory)
        except Exception as e:
            logger.exception("EngineCore failed to start")
            self._send_direct(ReadyMessage(status="FAILED", error=f"{type(e).__name__}: {e}"))
            self._close_sockets()
            raise
        self.engine_core.executor.set_failure_callback(self._on_executor_failure)
        self._send_direct(
            ReadyMessage(
                num_kv_blocks=self.engine_core.kv_cache_config.num_blocks,
                max_model_len=self.engine_core.max_model_len,
            )
        )
        self.input_thread.start()
        self.output_thread.start()

    # ---- lifecycle ----
    def run(self) -> int:
        """Run the busy loop until shutdown; returns the process exit code."""
        code = 0
        try:
            self._busy_loop()
        except SystemExit:
            logger.info("EngineCore shutting down on a signal")
        except BaseException as e:  # noqa: BLE001 - any escape is fatal: tell the frontend first
            logger.exception("EngineCore died")
            self.output_queue.put(
                EngineCoreOutputs(engine_dead=True, error=f"{type(e).__name__}: {e}")
            )
            code = 1
        finally:
            self.stopping.set()
            self.output_queue.put(None)
            self.output_thread.join(timeout=5)
            try:
                self.engine_core.shutdown()
            finally:
                self._close_sockets()
        return code

    def request_shutdown(self) -> None:
        self.input_queue.put(_SHUTDOWN)

    def _on_executor_failure(self, reason: str) -> None:
        """A worker died (executor's watcher thread): the busy loop dies loudly at its next
        message; if it is stuck in a step (a collective that never returns), the dead sentinel
        goes out from here and the process exits (its workers die with it)."""
        self.input_queue.put(_Fatal(reason))
        threading.Thread(
            target=self._exit_if_stuck, args=(reason,), name="StuckStepWatch", daemon=True
        ).start()

    def _exit_if_stuck(self, reason: str) -> None:
        if self.stopping.wait(STUCK_STEP_S):
            return
        logger.error("EngineCore stuck after a worker died (%s); exiting", reason)
        self.output_queue.put(EngineCoreOutputs(engine_dead=True, error=f"RuntimeError: {reason}"))
        self.output_queue.put(None)
        self.output_thread.join(timeout=2)
        os._exit(1)

    def _close_sockets(self) -> None:
        if self.input_thread.ident is None:
            self.input_socket.close(linger=0)
        # else: the input thread closes its own socket (term() below wakes it from recv).
        for sock in self.output_sockets:
            sock.close()  # keeps LINGER: queued messages still go out
        self.zmq_ctx.term()

    def _send_direct(self, message: msgspec.Struct) -> None:
        """Sends to every frontend from this thread (only before the output thread runs)."""
        frames = MsgpackEncoder().encode(message)
        for sock in self.output_sockets:
            sock.send_multipart(frames)

    # ---- busy loop ----
    def _busy_loop(self) -> None:
        core = self.engine_core
        raise_full_collection_threshold()  # this process only steps the engine
        while True:
            # Block for input only when there is nothing to step.
            if not self._process_input(block=not core.has_work()):
                return
            if not core.has_work():
                continue
            outputs = core.step()
            # Yield the GIL: a step of pure-Python work would otherwise starve the input
            # thread for many steps (aborts would land late).
            time.sleep(0)
            self._apply_eager_aborts(outputs)
            if outputs.outputs:
                outputs.scheduler_stats = core.scheduler.make_stats()
                self.output_queue.put(outputs)

    def _process_input(self, block: bool) -> bool:
        """Applies every queued message, in arrival order; False on shutdown."""
        while True:
            try:
                item = self.input_queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _SHUTDOWN:
                return False
            if isinstance(item, _Fatal):
                raise RuntimeError(item.error)
            seq, kind, payload = item
            self._last_seq = seq
            if kind is EngineCoreRequestType.ADD:
                self.engine_core.add_request(payload)
            elif kind is EngineCoreRequestType.ADD_MANY:
                for request in payload:
                    self.engine_core.add_request(request)
            elif kind is EngineCoreRequestType.ABORT:
                self.engine_core.abort_requests(payload)
            elif kind is EngineCoreRequestType.UTILITY:
                self._call_utility(payload)
            else:  # an error output for a message that could not be decoded
                self.output_queue.put(payload)

    def _apply_eager_aborts(self, outputs: EngineCoreOutputs) -> None:
        """Aborts that arrived while the step ran take effect now, before its outputs go out.

        Only aborts newer than the last message applied count: nothing was added to the
        scheduler since, so they name the requests the frontend meant. The queued copies are
        applied again in order later, as no-ops."""
        with self._abort_lock:
            pending, self._eager_aborts = self._eager_aborts, []
        req_ids = {r for seq, ids in pending if seq > self._last_seq for r in ids}
        if not req_ids:
            return
        self.engine_core.abort_requests(list(req_ids))
        outputs.outputs = [o for o in outputs.outputs if o.request_id not in req_ids]

    def _call_utility(self, call: UtilityRequest) -> None:
        try:
            result = self.engine_core.call_utility(call.method, list(call.args))
            out = UtilityOutput(call.call_id, result=result, client_index=call.client_index)
        except Exception as e:  # noqa: BLE001 - a failed call is the caller's error, not ours
            message = f"{type(e).__name__}: {e}"
            out = UtilityOutput(
                call.call_id, failure_message=message, client_index=call.client_index
            )
        self.output_queue.put(EngineCoreOutputs(utility_output=out, timestamp=now()))

    # ---- I/O threads ----
    def _input_loop(self) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ADD_MANY: MsgpackDecoder(list[EngineCoreRequest]),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
        }
        seq = 0
        try:
            while True:
                frames = self.input_socket.recv_multipart(copy=False)
                seq += 1
                try:
                    kind = EngineCoreRequestType(frames[0].bytes)
                except ValueError:
                    logger.error("dropped a message of unknown type %r", frames[0].bytes[:16])
                    continue
                if kind is EngineCoreRequestType.SHUTDOWN:
                    logger.info("EngineCore got SHUTDOWN")
                    self.request_shutdown()
                    return
                try:
                    payload = decoders[kind].decode(frames[1:])
                except Exception as e:  # noqa: BLE001 - bad input is the sender's error, not ours
                    if not isinstance(e, DecodeError):  # e.g. a params check that raised oddly
                        logger.exception("could not decode a %s message", kind.name)
                        e = DecodeError(f"malformed message: {type(e).__name__}: {e}")
                    logger.error("dropped a malformed %s message: %s", kind.name, e)
                    answer = _answer_undecodable(kind, frames[1:], str(e))
                    if answer is not None:
                        self.input_queue.put((seq, None, answer))
                    continue
                if kind is EngineCoreRequestType.ABORT:
                    self.router.forget(payload)  # here: in arrival order with the ADDs
                    with self._abort_lock:
                        self._eager_aborts.append((seq, payload))
                elif kind is EngineCoreRequestType.ADD:
                    self.router.add(payload)
                    if payload.encoder_input is not None:
                        _hash_audio(payload.encoder_input)
                elif kind is EngineCoreRequestType.ADD_MANY:
                    for request in payload:
                        self.router.add(request)
                        if request.encoder_input is not None:
                            _hash_audio(request.encoder_input)
                self.input_queue.put((seq, kind, payload))
        except zmq.ContextTerminated:
            return
        except Exception as e:  # noqa: BLE001 - without input the core is useless: die loudly
            logger.exception("EngineCore input thread failed")
            self.input_queue.put(_Fatal(f"input thread failed: {type(e).__name__}: {e}"))
        finally:
            self.input_socket.close(linger=0)

    def _output_loop(self) -> None:
        encoder = MsgpackEncoder(share_views=True)  # a pooling step's rows: one frame
        try:
            while True:
                outputs = self.output_queue.get()
                if outputs is None:
                    return
                for index, routed in self.router.split(outputs):
                    try:
                        frames = encoder.encode(routed)
                    except (TypeError, ValueError, OverflowError) as e:
                        frames = encoder.encode(_unencodable(routed, f"{type(e).__name__}: {e}"))
                    self.output_sockets[index].send_multipart(frames, copy=False)
        except Exception as e:  # noqa: BLE001 - outputs can no longer leave: stop the core
            logger.exception("EngineCore output thread failed")
            self.input_queue.put(_Fatal(f"output thread failed: {type(e).__name__}: {e}"))


class OutputRouter:
    """Which frontend each output goes to, for a core shared by `num_frontends` frontends:
    a request's outputs go to the frontend that sent it (EngineCoreRequest.client_index, kept
    until its final output), a utility answer to the one that called, the dead sentinel and
    outputs of requests it does not know (errors for undecodable messages) to every one.
    Written by the input thread (`add`), read by the output thread (`split`)."""

    def __init__(self, num_frontends: int) -> None:
        self.num_frontends = num_frontends
        self._client_of: dict[str, int] = {}

    def add(self, request: EngineCoreRequest) -> None:
        if self.num_frontends > 1:
            self._client_of[request.request_id] = self._index(request.client_index)

    def _index(self, client_index: int) -> int:
        """A frontend's index; one out of range (a custom frontend's) is frontend 0's."""
        return client_index if 0 <= client_index < self.num_frontends else 0

    def split(self, outputs: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        if self.num_frontends == 1:
            return [(0, outputs)]
        if outputs.engine_dead:
            return [(i, outputs) for i in range(self.num_frontends)]
        per_client: dict[int, list[EngineCoreOutput]] = {}
        unrouted: list[EngineCoreOutput] = []
        for out in outputs.outputs:
            if out.finish_reason is not None:  # its last output: forget it
                index = self._client_of.pop(out.request_id, None)
            else:
                index = self._client_of.get(out.request_id)
            if index is None:
                unrouted.append(out)
            else:
                per_client.setdefault(index, []).append(out)
        utility = outputs.utility_output
        utility_index = None if utility is None else self._index(utility.client_index)
        routed = []
        for index in range(self.num_frontends):
            mine = per_client.get(index, []) + unrouted
            if mine or index == utility_index:
                routed.append(
                    (
                        index,
                        EngineCoreOutputs(
                            outputs=mine,
                            timestamp=outputs.timestamp,
                            scheduler_stats=outputs.scheduler_stats,
                            utility_output=utility if index == utility_index else None,
                        ),
                    )
                )
        return routed

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests (their frontend gave them up: no final output is owed)."""
        for req_id in request_ids:
            self._client_of.pop(req_id, None)


def _hash_audio(enc: EncoderInput) -> None:
    """Hashes audio sent without its content hash here, on the input thread (blake3 releases
    the GIL: the busy loop keeps stepping); anything else unhashed fails in `add_request`."""
    with contextlib.suppress(ValueError):
        with_content_hash(enc)


def _answer_undecodable(
    kind: EngineCoreRequestType, frames: list[Any], error: str
) -> EngineCoreOutputs | None:
    """An error reply to an undecodable ADD or ADD_MANY (by request id: every request of the
    message) or UTILITY (by call id), when those ids can still be read; the sender would
    otherwise wait forever."""
    try:
        raw = msgspec.msgpack.decode(frames[0].bytes if frames else b"")
    except (msgspec.DecodeError, ValueError):
        return None
    if kind is EngineCoreRequestType.ADD and isinstance(raw, dict):
        raw = [raw]
    if kind in (EngineCoreRequestType.ADD, EngineCoreRequestType.ADD_MANY) and isinstance(
        raw, list
    ):  # every request whose id can be read fails (the message is one unit)
        ids = [r.get("request_id") for r in raw if isinstance(r, dict)]
        outs = [
            EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, error=error)
            for req_id in ids
            if isinstance(req_id, str)
        ]
        return EngineCoreOutputs(outputs=outs, timestamp=now()) if outs else None
    call_id = raw[0] if isinstance(raw, list) and raw else None
    if kind is EngineCoreRequestType.UTILITY and type(call_id) is int:
        index = raw[3] if len(raw) > 3 and type(raw[3]) is int else 0
        out = UtilityOutput(call_id, failure_message=error, client_index=index)
        return EngineCoreOutputs(utility_output=out, timestamp=now())
    return None


def _unencodable(outputs: EngineCoreOutputs, error: str) -> EngineCoreOutputs:
    """What to send instead of outputs that cannot be encoded: a failed utility call, else the
    dead sentinel (a request output the wire cannot carry is an engine bug)."""
    utility = outputs.utility_output
    if utility is not None and not outputs.outputs:
        failed = UtilityOutput(
            utility.call_id, failure_message=error, client_index=utility.client_index
        )
        return EngineCoreOutputs(utility_output=failed)
    logger.error("cannot encode EngineCoreOutputs: %s", error)
    return EngineCoreOutputs(engine_dead=True, error=f"cannot encode outputs: {error}")


# ---- process entry point ----
class _ParentWatch(threading.Thread):
    """Exits the process when the frontend that started it is gone: at once while the core is
    still starting, through a graceful shutdown once it serves (`proc` set). The frontend is
    gone when its pid is no longer our parent, or (`watch_stdin`) when our stdin, a pipe only
    the frontend writes, reaches end-of-file. Then the ipc directory goes too (`ipc_dir`): the
    frontend cannot remove it any more."""

    def __init__(self, parent_pid: int, watch_stdin: bool, ipc_dir: str | None) -> None:
        super().__init__(name="ParentWatch", daemon=True)
        self.parent_pid = parent_pid
        self.stdin_fd = sys.stdin.fileno() if watch_stdin else None
        self.ipc_dir = ipc_dir
        self.proc: EngineCoreProc | None = None
        self.stopped = threading.Event()
        self.parent_gone = threading.Event()

    def run(self) -> None:
        from multiprocessing.connection import wait

        fd = self.stdin_fd
        while not self.stopped.is_set():
            gone = False
            if fd is not None:
                if wait([fd], timeout=PARENT_POLL_S):
                    gone = not os.read(fd, 65536)  # end-of-file; data is ignored
                    if gone:
                        fd = None  # stays readable at EOF: poll the pid from now on
            else:
                self.stopped.wait(PARENT_POLL_S)
            gone = gone or os.getppid() != self.parent_pid
            if not gone or self.stopped.is_set():
                continue
            logger.warning("the frontend process %d is gone; EngineCore exits", self.parent_pid)
            self.parent_gone.set()
            proc = self.proc
            if proc is not None:
                proc.request_shutdown()
                if proc.stopping.wait(PARENT_POLL_S * 2):
                    return
            self.remove_ipc_dir()
            os._exit(1)  # still starting, or stuck in a step: nobody waits for it

    def remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None and self.parent_gone.is_set():
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


@dataclass(frozen=True)
class CoreOptions:
    """How a frontend started this core (everything but the config and the addresses)."""

    parent_pid: int | None = None
    """The frontend's pid (default: our parent)."""
    watch_stdin: bool = False
    """stdin is a pipe from the frontend: end-of-file means it is gone."""
    ipc_dir: str | None = None
    """The frontend's private socket directory, removed if the frontend dies first."""


def run_engine_core(
    config_json: str,
    input_address: str,
    output_address: str,
    choose_executor: Callable[[EngineConfig], ExecutorFactory],
    options: CoreOptions | None = None,
    extra_frontends: tuple[tuple[str, str], ...] = (),
) -> None:
    """Process entry point: build the core with the executor `choose_executor` picks for the
    config (the program above the core decides), answer the handshake, serve until shutdown.
    `extra_frontends`: (input, output) addresses of frontends 1, 2, ... sharing the core."""
    options = options or CoreOptions()
    # Ctrl-C in a terminal reaches the whole process group; the frontend decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    parent_pid = os.getppid() if options.parent_pid is None else options.parent_pid
    watch = _ParentWatch(parent_pid, options.watch_stdin, options.ipc_dir)
    watch.start()  # before the (possibly long) model load
    addresses = CoreAddresses(input_address, output_address, tuple(extra_frontends))
    try:
        config = EngineConfig.from_json(config_json)
        factory = choose_executor(config)
    except Exception as e:
        logger.exception("bad EngineCore arguments")
        for address in addresses.outputs:
            _send_failed_handshake(address, f"{type(e).__name__}: {e}")
        sys.exit(1)
    try:
        proc = EngineCoreProc(config, addresses, factory)
    except Exception:
        sys.exit(1)  # the failed handshake is already sent
    watch.proc = proc
    code = proc.run()
    watch.stopped.set()
    watch.remove_ipc_dir()
    # Everything is released; skip the interpreter's teardown of torch & co (seconds).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _send_failed_handshake(output_address: str, error: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(output_address)
    sock.send_multipart(MsgpackEncoder().encode(ReadyMessage(status="FAILED", error=error)))
    sock.close()
    ctx.term()
