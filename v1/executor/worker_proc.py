"""A tensor-parallel worker process (ranks 1..N-1; rank 0 runs inside the EngineCore). It joins
the process group, loads its shard, then applies the SchedulerOutputs and set-up calls its
executor sends (msgspec over ZMQ ipc, no pickle); it replies to set-up calls only. Its stdin, a
pipe only the core writes, reaching end-of-file ends it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
import zmq

from v1.config import EngineConfig
from v1.core.sched_output import SchedulerOutput
from v1.core.serial import MsgpackDecoder, MsgpackEncoder
from v1.logger import init_logger

logger = init_logger(__name__)

PARENT_POLL_S = 0.5


class WorkerMethod(Enum):
    """Frame 0 of a message to a worker; the payload (if any) follows, msgspec-encoded."""

    EXECUTE = b"E"
    """SchedulerOutput: run the step (no reply)."""
    EXECUTE_ASYNC = b"L"
    """SchedulerOutput: launch the step (pipelined scheduling; no reply)."""
    READ_BACK = b"R"
    """Read back the oldest launched step, as rank 0 does now (the same order on every rank)."""
    AVAILABLE_KV_BYTES = b"A"
    """Reply this rank's KV cache budget (profiled on GPU)."""
    INIT_KV_CACHE = b"K"
    """int: allocate the cache for this many blocks (the layout follows from the specs)."""
    SHUTDOWN = b"Q"


class WorkerReply(msgspec.Struct, array_like=True):
    rank: int
    method: str
    """The WorkerMethod name, or "READY" after the model loaded."""
    value: int | str | None = None
    error: str | None = None


@dataclass(frozen=True)
class WorkerAddresses:
    input: str
    """Core PUSH -> this worker's PULL."""
    output: str
    """Every worker's PUSH -> the core's PULL (replies)."""


class WorkerProc:
    """The message loop around one Worker of rank >= 1."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        addresses: WorkerAddresses,
        init_method: str,
        local_rank: int | None = None,
    ) -> None:
        self.rank = rank
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(addresses.input)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(addresses.output)
        self.encoder = MsgpackEncoder()
        from v1.worker.worker import Worker

        try:
            self.worker = Worker(config, rank, local_rank, init_method)
            self.worker.load_model()
        except Exception as e:
            self.reply("READY", error=f"{type(e).__name__}: {e}")
            raise
        self.reply("READY")

    def reply(self, method: str, value: Any = None, error: str | None = None) -> None:
        message = WorkerReply(self.rank, method, value, error)
        self.output.send_multipart(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        step_decoder = MsgpackDecoder(SchedulerOutput)
        int_decoder = MsgpackDecoder(int)
        worker = self.worker
        launched: deque[Any] = deque()
        while True:
            frames = self.input.recv_multipart(copy=False)
            method = WorkerMethod(frames[0].bytes)
            payload = frames[1:]
            if method is WorkerMethod.EXECUTE:
                worker.execute_model(step_decoder.decode(payload))
            elif method is WorkerMethod.EXECUTE_ASYNC:
                launched.append(worker.execute_model_async(step_decoder.decode(payload)))
            elif method is WorkerMethod.READ_BACK:
                launched.popleft().get_output()
            elif method is WorkerMethod.AVAILABLE_KV_BYTES:
                self.reply(method.name, worker.determine_available_kv_bytes())
            elif method is WorkerMethod.INIT_KV_CACHE:
                from v1.kv_cache.sizing import get_kv_cache_config

                num_blocks = int_decoder.decode(payload)
                specs = worker.get_kv_cache_specs()
                worker.initialize_kv_cache(get_kv_cache_config(specs, num_blocks=num_blocks))
                self.reply(method.name)
            else:
                return

    def close(self) -> None:
        self.worker.shutdown()
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def _die_with_parent(parent_pid: int) -> None:
    """A thread ends the process when stdin (a pipe only the parent writes, so it closes only
    when the parent is gone, however it died) reaches end-of-file or the parent pid changes.
    (Not PR_SET_PDEATHSIG: it fires when the parent's *thread* that started us exits.)"""
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before we started watching

    def watch() -> None:
        from multiprocessing.connection import wait

        fd = sys.stdin.fileno()
        while True:
            if wait([fd], timeout=PARENT_POLL_S) and not os.read(fd, 65536):
                os._exit(1)  # end-of-file: the core is gone
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="ParentWatch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """`python -m v1.executor.worker_proc --rank R --input ADDR --output ADDR
    --init-method URL --parent-pid PID`, the EngineCore's JSON config on stdin's first line."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=None)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides (Ctrl-C reaches the group)
    config_json = sys.stdin.buffer.readline().decode()
    _die_with_parent(args.parent_pid)
    config = EngineConfig.from_json(config_json)
    code = 0
    try:
        proc = WorkerProc(
            config,
            args.rank,
            WorkerAddresses(args.input, args.output),
            args.init_method,
            args.local_rank,
        )
        proc.run()
        proc.close()
    except BaseException:  # noqa: BLE001 - any failure ends the worker; the core sees it exit
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
