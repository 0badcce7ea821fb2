"""Data parallelism: N EngineCore processes behind one client (`data_parallel_size=N`), each
the ordinary core program on its own device set. `CoreLoadBalancer` routes a request to the
least-loaded core, the one that last took its encoder content (by hash, or by a sampled
fingerprint of audio the frontend leaves the cores to hash), or (`fork_from`) its parent's;
aborts go to the owning core. One core's death is the engine's: every pending request fails
with EngineDeadError and the other cores are stopped.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from blake3 import blake3

from v1.config import EngineConfig
from v1.core.client import EngineCoreClient, HeldAdds
from v1.core.errors import EngineCoreStartError, EngineDeadError
from v1.core.mp_client import _DEAD, BlockingOutputQueue, LoopOutputQueue, MPClient, _Dead
from v1.core.process_handles import AttachedCore
from v1.core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from v1.logger import init_logger

logger = init_logger(__name__)

_COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)
_AFFINITY_CAPACITY = 4096
"""Encoder content hashes remembered for routing (far more than any core's encoder cache
holds, so a hash seen recently still finds the core that may have it cached)."""
_FINGERPRINT_BLOCKS = 32
_FINGERPRINT_BLOCK = 64
"""Audio routing fingerprints read this many evenly spaced runs of this many samples."""


def audio_fingerprint(samples: np.ndarray) -> str:
    """A routing key for audio sent unhashed (the cores hash it): a digest of its length, dtype
    and 32 evenly spaced runs of 64 samples (~8 KB of a 1.9 MB window: microseconds, where
    BLAKE3 over all of it takes ~0.5 ms of the one frontend thread). Equal audio gets equal
    keys, so it meets its encoder output in one core; different audio with equal keys only
    shares a core (the cores' encoder caches key on the full BLAKE3 hash)."""
    flat = samples.reshape(-1)
    n = flat.shape[0]
    if n > _FINGERPRINT_BLOCKS * _FINGERPRINT_BLOCK:
        flat = flat.take(_fingerprint_index(n))
    digest = blake3(np.ascontiguousarray(flat).view(np.uint8).data)
    digest.update(f"|{n}|{samples.dtype.str}".encode())
    return "audio:" + digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _fingerprint_index(n: int) -> np.ndarray:
    starts = np.linspace(0, n - _FINGERPRINT_BLOCK, _FINGERPRINT_BLOCKS).astype(np.int64)
    return (starts[:, None] + np.arange(_FINGERPRINT_BLOCK)).reshape(-1)


def routing_key(request: EngineCoreRequest) -> str | None:
    """What `CoreLoadBalancer` keeps a request's encoder input on one core by: its content
    hash, or for audio sent without one its `audio_fingerprint`."""
    enc = request.encoder_input
    if enc is None:
        return None
    if enc.content_hash:
        return enc.content_hash
    if isinstance(enc.audio, np.ndarray) and enc.audio.size:
        return audio_fingerprint(enc.audio)
    return None


def core_device_envs(config: EngineConfig) -> list[dict[str, str]]:
    """Per core, the environment that gives it its own device set: on CUDA a slice of the
    visible devices (`tensor_parallel_size` each); on CPU its share of the host's cores as
    OMP_NUM_THREADS (torch sizes its thread pool from it at start-up; without it every core
    spins one thread per host core and the cores starve each other, 4-10x slower than one)."""
    pc = config.parallel_config
    num_cores = pc.data_parallel_size
    if config.device_config.device_type != "cuda":
        share = cpu_threads_per_rank(num_cores * pc.tensor_parallel_size)
        return [{"OMP_NUM_THREADS": str(share)} for _ in range(num_cores)]
    if config.device_config.device != "auto" and ":" in config.device_config.device:
        raise ValueError(
            f"data_parallel_size={num_cores} gives each core its own devices; use device "
            f"'cuda' (and CUDA_VISIBLE_DEVICES), not {config.device_config.device!r}"
        )
    visible = config.device_config.visible_cuda_devices()
    per_core = pc.tensor_parallel_size
    if len(visible) < num_cores * per_core:
        raise ValueError(
            f"data_parallel_size={num_cores} x tensor_parallel_size={per_core} needs "
            f"{num_cores * per_core} CUDA devices; {len(visible)} visible"
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(visible[i * per_core : (i + 1) * per_core])}
        for i in range(num_cores)
    ]


def cpu_threads_per_rank(num_ranks: int) -> int:
    """Threads each of `num_ranks` processes sharing this host's cores (its affinity) may use."""
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (num_cpus or 1) // num_ranks)


class CoreLoadBalancer:
    """Picks a core per request and remembers which core owns which request.

    Load of a core = the requests this client sent it that have not finished (every request a
    core runs comes through its one client, so the count is exact). Counting from the cores'
    reported `SchedulerStats` instead was stale: a report computed before the core read the
    latest sends reset their count, so the cores that report often drew more requests (4 H200s,
    2,048 equal clips: the busiest core took 9% more than the mean, which alone caps DP 4 at
    3.66x). Ties go to the lower index. Not thread-safe: the client locks."""

    def __init__(self, num_cores: int, affinity_capacity: int = _AFFINITY_CAPACITY) -> None:
        self.num_cores = num_cores
        self.num_in_flight = [0] * num_cores
        self.owner: dict[str, int] = {}
        self._holds_kv: set[str] = set()
        """Requests in flight sent with hold_kv."""
        self.held_owner: dict[str, int] = {}
        """Finished hold_kv requests -> the core holding their KV (until released)."""
        self._affinity: OrderedDict[str, int] = OrderedDict()
        """`routing_key` -> the core that last took it."""
        self._affinity_capacity = affinity_capacity

    def load(self, core: int) -> int:
        return self.num_in_flight[core]

    def assign(self, request: EngineCoreRequest) -> int:
        """The core `request` goes to (recorded as its owner)."""
        key = routing_key(request)
        core = None
        if request.fork_from is not None:
            # The parent's KV is on one core: fork there (its last fork releases it).
            get = self.held_owner.pop if request.last_fork else self.held_owner.get
            core = get(request.fork_from, None)
        if core is None and key is not None:
            core = self._affinity.get(key)
        if core is None:
            core = min(range(self.num_cores), key=lambda i: (self.num_in_flight[i], i))
        if key is not None:
            self._affinity[key] = core
            self._affinity.move_to_end(key)
            if len(self._affinity) > self._affinity_capacity:
                self._affinity.popitem(last=False)
        self.owner[request.request_id] = core
        if request.hold_kv:
            self._holds_kv.add(request.request_id)
        self.num_in_flight[core] += 1
        return core

    def release(self, request_ids: Sequence[str], finished: bool = False) -> dict[int, list[str]]:
        """Forgets finished or aborted requests (an abort also releases held ones); the known
        ones grouped by their core. A finished hold_kv request stays known as held."""
        by_core: dict[int, list[str]] = {}
        for req_id in request_ids:
            core = self.owner.pop(req_id, None)
            if core is not None:
                self.num_in_flight[core] -= 1
                if req_id in self._holds_kv:
                    self._holds_kv.discard(req_id)
                    if finished:
                        self.held_owner[req_id] = core
            elif not finished:
                core = self.held_owner.pop(req_id, None)
            if core is not None:
                by_core.setdefault(core, []).append(req_id)
        return by_core


class _CoreClient(MPClient):
    """One data-parallel core: an MPClient that hands its outputs to the DP client."""

    def __init__(
        self,
        config: EngineConfig,
        index: int,
        sink: Callable[[int, EngineCoreOutputs | _Dead], None],
        **kwargs: Any,
    ) -> None:
        self.index = index
        self._sink = sink
        super().__init__(config, **kwargs)

    def _deliver(self, item: EngineCoreOutputs | _Dead) -> None:
        self._sink(self.index, item)

    def send_add(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def send_abort(self, request_ids: list[str]) -> None:
        self._send(EngineCoreRequestType.ABORT, request_ids)

    def start_utility(self, method: str, args: Sequence[Any]) -> Future:
        return self._start_utility(method, args)


def merge_stats(per_core: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the cores' `get_stats`: counters summed, KV usage over all blocks, and each
    core's own stats under `data_parallel`."""
    merged: dict[str, Any] = {}
    for stats in per_core:
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    total = merged.get("num_total_blocks", 0)
    merged["kv_cache_usage"] = merged.get("num_used_blocks", 0) / total if total else 0.0
    merged["data_parallel"] = per_core
    return merged


def _merge_utility(method: str, results: list[Any]) -> Any:
    if method == "get_stats":
        return merge_stats(results)
    if method in ("is_healthy", "reset_prefix_cache"):
        return all(results)
    if method == "get_config_info":
        info = dict(results[0])
        info["num_kv_blocks"] = sum(r["num_kv_blocks"] for r in results)
        info["data_parallel"] = results
        return info
    return results


class DPClient(EngineCoreClient):
    """Starts `data_parallel_size` cores and routes between them; subclasses deliver outputs."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        program: str,
        executor_factory: str | None = None,
        ready_timeout_s: float | None = None,
        input_address: str | None = None,
        output_address: str | None = None,
        extra_frontends: int = 0,
        attach: Sequence[AttachedCore] | None = None,
    ) -> None:
        """`program`, `executor_factory`, `ready_timeout_s`: as MPClient's, for every core. Each core binds
        its own private ipc:// sockets, so explicit addresses are refused. `extra_frontends`:
        every core also serves that many other frontends (`frontend_addresses`, per core);
        `attach`: share cores another DP client started, one `AttachedCore` per core."""
        if input_address is not None or output_address is not None:
            raise ValueError("a data-parallel engine binds one private ipc:// pair per core")
        num_cores = config.parallel_config.data_parallel_size
        if attach is not None and len(attach) != num_cores:
            raise ValueError(f"attach names {len(attach)} cores; data_parallel_size={num_cores}")
        self.config = config
        self._lock = threading.Lock()
        self._held = HeldAdds(dict, self._send_held)
        self._dead_error: str | None = None
        self._closing = False
        self.balancer = CoreLoadBalancer(num_cores)
        envs = core_device_envs(config)
        kwargs = {
            "program": program,
            "executor_factory": executor_factory,
            "ready_timeout_s": ready_timeout_s,
            "extra_frontends": extra_frontends,
        }
        self.cores: list[_CoreClient] = []
        # Start the cores side by side: each spends its start-up loading the model.
        with ThreadPoolExecutor(num_cores, thread_name_prefix="v1-dp-start") as pool:
            futures = [
                pool.submit(
                    _CoreClient,
                    config,
                    i,
                    self._on_core_output,
                    core_env=envs[i],
                    attach=None if attach is None else attach[i],
                    **kwargs,
                )
                for i in range(num_cores)
            ]
            errors = []
            for fut in futures:
                try:
                    self.cores.append(fut.result())
                except BaseException as e:  # noqa: BLE001 - stop the others, then raise the first
                    errors.append(e)
        if errors:
            self._closing = True
            for core in self.cores:
                core.shutdown()
            raise errors[0]
        if self._dead_error is not None:  # one core died while the others were starting
            self.shutdown()
            raise EngineCoreStartError(self._dead_error)
        self.max_model_len = self.cores[0].max_model_len
        self.num_kv_blocks = sum(core.num_kv_blocks for core in self.cores)
        logger.info("data parallelism: %d EngineCores (pids %s)", num_cores, self.pids)

    # ---- outputs from the cores' reader threads ----
    def _on_core_output(self, index: int, item: EngineCoreOutputs | _Dead) -> None:
        if isinstance(item, _Dead):
            self._core_died(index)
            return
        # Requests that stopped or hit their length may stay held (hold_kv); failed ones not.
        ended = [o for o in item.outputs if o.finished]
        completed = [o.request_id for o in ended if o.finish_reason in _COMPLETED]
        failed = [o.request_id for o in ended if o.finish_reason not in _COMPLETED]
        with self._lock:
            if completed:
                self.balancer.release(completed, finished=True)
            if failed:
                self.balancer.release(failed)
        self._deliver(item)

    def _core_died(self, index: int) -> None:
        core = self.cores[index] if index < len(self.cores) else None
        reason = core.dead_error if core is not None else None
        with self._lock:
            if self._dead_error is not None:
                return  # already dead (or shut down): the other cores' ends are expected
            self._dead_error = f"data-parallel EngineCore {index} is gone: {reason}"
        logger.error("%s; failing every pending request and stopping the other cores", reason)
        self._deliver(_DEAD)
        # Not on this reader thread: stopping a core joins its reader.
        threading.Thread(target=self._stop_cores, name="v1-dp-stop", daemon=True).start()

    def _stop_cores(self) -> None:
        for core in self.cores:
            core.shutdown()

    @abstractmethod
    def _deliver(self, item: EngineCoreOutputs | _Dead) -> None:
        """Queues a core's outputs (or the death marker) for the frontend."""

    # ---- routing ----
    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)

    def _send_add(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self._check_alive()
            core = self.balancer.assign(request)
        held = self._held.requests
        if held is not None:  # a `batched_adds` block: routed now, sent when it ends
            held.setdefault(core, []).append(request)
            return
        try:
            self.cores[core].send_add(request)
        except BaseException:
            with self._lock:
                self.balancer.release([request.request_id])
            raise

    def _send_held(self, held: dict[int, list[EngineCoreRequest]]) -> None:
        """Each core's held requests in one message; a failed send forgets the requests that
        did not go out."""
        unsent = dict(held)
        try:
            for core, requests in held.items():
                self.cores[core].send_adds(requests)
                del unsent[core]
        except BaseException:
            with self._lock:
                self.balancer.release([r.request_id for rs in unsent.values() for r in rs])
            raise

    def _send_abort(self, request_ids: list[str]) -> None:
        """The frontend gave these requests up: forget them and tell their cores (ids of
        finished or unknown requests are dropped; no core holds them)."""
        with self._lock:
            by_core = self.balancer.release(request_ids)
        for core, ids in by_core.items():
            self.cores[core].send_abort(ids)

    def _start_utilities(self, method: str, args: Sequence[Any]) -> list[Future]:
        self._check_alive()
        return [core.start_utility(method, args) for core in self.cores]

    # ---- shared API ----
    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    @property
    def pids(self) -> list[int]:
        return [core.pid for core in self.cores]

    @property
    def frontend_addresses(self) -> list[list[tuple[str, str]]]:
        """Per core, its extra frontends' (input, output) addresses (`extra_frontends`)."""
        return [core.frontend_addresses for core in self.cores]

    def core_of(self, request_id: str) -> int | None:
        """The index of the core that holds `request_id` (None once it finished or aborted)."""
        with self._lock:
            return self.balancer.owner.get(request_id)

    def shutdown(self) -> None:
        """Stops every core; pending and later calls raise EngineDeadError. Idempotent."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            if self._dead_error is None:
                self._dead_error = "the EngineCore client was shut down"
        self._deliver(_DEAD)
        self._stop_cores()


class SyncDPClient(BlockingOutputQueue, DPClient):
    """Blocking data-parallel client (LLM): the SyncMPClient interface."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self._init_blocking_queue()
        super().__init__(config, **kwargs)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_add(request)

    def batched_adds(self) -> AbstractContextManager[None]:
        """See `EngineCoreClient.batched_adds`: each request is routed when added, and each
        core gets its held requests as one ADD_MANY message when the block ends."""
        return self._held.block()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._held.flush()
            self._send_abort(list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        self._held.flush()
        futures = self._start_utilities(method, args)
        return _merge_utility(method, [fut.result() for fut in futures])


class AsyncDPClient(LoopOutputQueue, DPClient):
    """asyncio data-parallel client (AsyncLLM, the server): the AsyncMPClient interface,
    outputs through a `LoopOutputQueue`."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self._init_loop_queue()
        super().__init__(config, **kwargs)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._send_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_abort(list(request_ids))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_abort(list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._next_output()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        futures = self._start_utilities(method, args)
        results = await asyncio.gather(*(asyncio.wrap_future(fut) for fut in futures))
        return _merge_utility(method, list(results))


__all__ = [
    "AsyncDPClient",
    "CoreLoadBalancer",
    "DPClient",
    "SyncDPClient",
    "core_device_envs",
    "merge_stats",
]
