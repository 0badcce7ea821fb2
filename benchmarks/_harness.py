"""Timing, the device's measured rates, transformers' batch sweep and the per-request probe of
our engine: the mechanics `offline.py`'s workloads share.

Every figure is a median of timed runs that follow a warm-up on full-size inputs; the spread
(min-max) travels with it. Nothing here knows a model.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


# ---------------------------------------------------------------- device and timing
@dataclass(frozen=True)
class Device:
    """Where both sides run; `sync` waits for queued device work (a no-op on CPU)."""

    name: str
    """torch device string: cuda, cuda:N or cpu."""

    @property
    def is_cuda(self) -> bool:
        return self.name.startswith("cuda")

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.name)

    def free(self) -> None:
        """Returns cached blocks so the next side (or the engine's memory profile) sees them."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def describe(self) -> str:
        if self.is_cuda:
            return torch.cuda.get_device_name(self.name)
        import platform

        return (
            f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        )


def timed(device: Device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of `fn()` with the device drained before and after, and its result."""
    device.sync()
    start = time.perf_counter()
    result = fn()
    device.sync()
    return time.perf_counter() - start, result


@dataclass(frozen=True)
class Samples:
    """Seconds of repeated timed runs of the same work."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def __len__(self) -> int:
        return len(self.seconds)


# ---------------------------------------------------------------- machine rates
@dataclass(frozen=True)
class Machine:
    """The device's measured GEMM rate and copy bandwidth (the roofline's two slopes)."""

    description: str
    gemm_flops_per_s: float
    """A large fp16 (fp32 on CPU) square matmul: 2 n^3 / median time."""
    copy_bytes_per_s: float
    """A large device-to-device copy: bytes read + bytes written / median time."""
    gemm_detail: str
    copy_detail: str

    def floor_seconds(self, flops: float, num_bytes: float) -> float:
        return max(flops / self.gemm_flops_per_s, num_bytes / self.copy_bytes_per_s)


def _median_seconds(device: Device, fn: Callable[[], Any], warmup: int, runs: int) -> float:
    for _ in range(warmup):
        fn()
    if device.is_cuda:
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    return statistics.median(timed(device, fn)[0] for _ in range(runs))


def measure_machine(device: Device, small: bool) -> Machine:
    """GEMM rate and copy bandwidth, medians of 10 runs each after 3 warm-ups (CUDA events on a
    GPU). `small`: CPU-sized problems for smoke runs."""
    dtype = torch.float16 if device.is_cuda else torch.float32
    n = 512 if small else 8192
    num_bytes = (16 << 20) if small else (1 << 30)
    gemm_s = _median_seconds(device, _matmul(n, dtype, device), warmup=3, runs=10)
    copy_s = _median_seconds(device, _copy(num_bytes, device), warmup=3, runs=10)
    device.free()
    dtype_name = str(dtype).removeprefix("torch.")
    return Machine(
        description=device.describe(),
        gemm_flops_per_s=2 * n**3 / gemm_s,
        copy_bytes_per_s=2 * num_bytes / copy_s,
        gemm_detail=f"{n}x{n}x{n} {dtype_name} matmul",
        copy_detail=f"{num_bytes >> 20} MiB copy, read + written",
    )


def _matmul(n: int, dtype: torch.dtype, device: Device) -> Callable[[], Any]:
    a = torch.randn(n, n, dtype=dtype, device=device.name)
    b = torch.randn(n, n, dtype=dtype, device=device.name)
    return lambda: torch.mm(a, b)


def _copy(num_bytes: int, device: Device) -> Callable[[], Any]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device.name).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# ---------------------------------------------------------------- transformers' batch sweep
@dataclass
class SweepPoint:
    batch: int
    samples: Samples | None = None
    status: str = "ok"
    """ok | OOM | slower (stopped after one run) | skipped (time budget)"""
    counts: list[int] | None = None
    """Tokens (or embeddings) per input of the last run at this batch."""
    peak_memory_bytes: int | None = None


@dataclass
class SweepResult:
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def best(self) -> SweepPoint | None:
        timed_points = [p for p in self.points if p.samples is not None and p.status == "ok"]
        return min(timed_points, key=lambda p: p.samples.median) if timed_points else None

    def describe(self, work: float, unit: str) -> str:
        parts = []
        for p in self.points:
            if p.samples is None:
                parts.append(f"batch {p.batch}: {p.status}")
                continue
            rate = work / p.samples.median
            runs = f"{len(p.samples)} run{'s' if len(p.samples) > 1 else ''}"
            extra = "" if p.status == "ok" else f", {p.status}"
            parts.append(f"batch {p.batch}: {rate:,.1f} {unit} ({runs}{extra})")
        return "; ".join(parts)


@dataclass(frozen=True)
class SweepPlan:
    batches: tuple[int, ...]
    """Largest first."""
    repeats: int
    budget_s: float
    """Wall seconds after which no further batch size is started."""
    exhaustive: bool
    """Time every batch size (explicit --hf-batches); else stop once throughput falls."""


def sweep_batches(
    device: Device,
    plan: SweepPlan,
    warm: Callable[[int], Any],
    run: Callable[[int, int], list[int]],
) -> SweepResult:
    """Times `run(batch, input_set)` for input sets 1..repeats at each batch size, largest
    first, each after `warm(batch)` (one full-shape batch or pass, untimed). Without
    `exhaustive`, a batch size whose first run is >10% slower than the best so far ends the
    sweep (throughput has peaked; smaller batches only add per-batch overhead). OOM moves on to
    the next smaller batch."""
    result = SweepResult()
    start = time.perf_counter()
    for batch in sorted(plan.batches, reverse=True):
        point = SweepPoint(batch)
        result.points.append(point)
        if time.perf_counter() - start > plan.budget_s:
            point.status = f"skipped (sweep budget of {plan.budget_s:.0f} s spent)"
            continue
        if device.is_cuda:
            torch.cuda.reset_peak_memory_stats(device.name)
        seconds: list[float] = []
        try:
            warm(batch)
            best = result.best
            for input_set in range(1, plan.repeats + 1):
                elapsed, point.counts = timed(device, lambda b=batch, s=input_set: run(b, s))
                seconds.append(elapsed)
                if (
                    not plan.exhaustive
                    and best is not None
                    and len(seconds) == 1
                    and elapsed > 1.10 * best.samples.median
                ):
                    point.status = "slower (stopped after one run)"
                    break
        except torch.OutOfMemoryError:
            point.status = "OOM"
        if point.status == "OOM":
            # Freed here, not in the handler: its traceback still holds the failed run's tensors.
            point.counts = None
            device.free()
            continue
        point.samples = Samples(tuple(seconds))
        if device.is_cuda:
            point.peak_memory_bytes = torch.cuda.max_memory_allocated(device.name)
        device.free()
        if point.status != "ok":
            break
    return result


def time_runs(
    device: Device, repeats: int, warm: Callable[[], Any], run: Callable[[int], Any]
) -> tuple[Samples, Any]:
    """`warm()` once, then `run(input_set)` for input sets 1..repeats: the samples and the last
    run's result."""
    warm()
    seconds, result = [], None
    for input_set in range(1, repeats + 1):
        elapsed, result = timed(device, lambda s=input_set: run(s))
        seconds.append(elapsed)
    return Samples(tuple(seconds)), result


# ---------------------------------------------------------------- our engine, observed
@dataclass
class ProbeReport:
    counts: list[int]
    """Tokens (generation) or embeddings (pooling) of each request, in the order added."""
    peak_running: int
    """Most requests one step ran (scheduler stats)."""
    used_blocks_at_peak: int
    """KV blocks in use at the step(s) with the most running requests (the largest such)."""
    total_blocks: int
    block_bytes: int | None
    """Bytes of one block id across the layers that share it (in-process engines only)."""
    peak_finished: int
    """Most requests finished by one step (the batch of pooling models, which finish in it)."""

    def memory_note(self) -> str:
        if not self.peak_running:
            if self.peak_finished:
                return f"peak batch {self.peak_finished} requests (finished in one step)"
            return "no step reported a batch"
        per_req_blocks = self.used_blocks_at_peak / self.peak_running
        text = f"peak batch {self.peak_running} requests"
        if per_req_blocks == 0:
            return text + " (no KV cache)"
        fits = int(self.total_blocks / per_req_blocks)
        if self.block_bytes is None:
            return (
                f"{text}; KV {per_req_blocks:,.0f} blocks per request at that step; the KV pool "
                f"({self.total_blocks:,} blocks) holds ~{fits:,} such requests "
                f"(bytes per block: run with --in-process)"
            )
        per_req = per_req_blocks * self.block_bytes
        pool = self.total_blocks * self.block_bytes
        return (
            f"{text}; KV {format_bytes(per_req)} per request at that step; the KV pool "
            f"({format_bytes(pool)}) holds ~{fits:,} such requests"
        )


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


class EngineProbe:
    """Observes one run of an `LLM` (used on the untimed warm-up): the output size of every
    request in the order it was added, and the peak batch and KV blocks the scheduler reported.
    Patches the engine instance's methods and restores them on exit."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.client = self.engine.engine_core
        self.order: list[str] = []
        self.sizes: dict[str, int] = {}
        self.peak_running = 0
        self.used_at_peak = 0
        self.total_blocks = 0
        self.peak_finished = 0

    def __enter__(self) -> EngineProbe:
        engine, client = self.engine, self.client
        add, step, get_output = engine.add_processed_request, engine.step, client.get_output
        add_core, add_packed = engine.add_core_requests, engine.add_packed_request

        def add_core_requests(requests: list[Any]) -> None:
            # Beam search steps (ids "<window>-beam<step>.<j>"): a window's output size is the
            # longest sequence any of its steps extended (its tokens so far plus one).
            for request in requests:
                window = request.request_id.rsplit("-beam", 1)[0]
                if window not in self.sizes:
                    self.order.append(window)
                size = len(request.output_token_ids or ()) + 1
                self.sizes[window] = max(self.sizes.get(window, 0), size)
            add_core(requests)

        def add_processed_request(request_id: str, *args: Any, **kwargs: Any) -> None:
            self.order.append(request_id)
            add(request_id, *args, **kwargs)

        def add_packed_request(request_id: str, inputs: list[Any], *args: Any, **kw: Any) -> None:
            # Packed pooling inputs (user id, ids, segment ids): each gets its own output.
            self.order.extend(user_id for user_id, _, _ in inputs)
            add_packed(request_id, inputs, *args, **kw)

        def step_and_count() -> list[Any]:
            outputs = step()
            finished = [out for out in outputs if out.finished]
            for out in finished:
                self.sizes[out.request_id] = output_size(out)
            self.peak_finished = max(self.peak_finished, len(finished))
            return outputs

        def get_output_and_stats() -> Any:
            outputs = get_output()
            stats = outputs.scheduler_stats
            if stats is not None:
                self.total_blocks = stats.num_total_blocks
                if stats.num_running_reqs > self.peak_running:
                    self.peak_running, self.used_at_peak = stats.num_running_reqs, 0
                if stats.num_running_reqs == self.peak_running:
                    self.used_at_peak = max(self.used_at_peak, stats.num_used_blocks)
            return outputs

        engine.add_processed_request = add_processed_request
        engine.add_core_requests = add_core_requests
        engine.add_packed_request = add_packed_request
        engine.step = step_and_count
        client.get_output = get_output_and_stats
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name in (
            (self.engine, "add_processed_request"),
            (self.engine, "add_core_requests"),
            (self.engine, "add_packed_request"),
            (self.engine, "step"),
            (self.client, "get_output"),
        ):
            obj.__dict__.pop(name, None)

    def report(self) -> ProbeReport:
        core = getattr(self.client, "engine_core", None)
        kv_config = getattr(core, "kv_cache_config", None)
        block_bytes = None
        if kv_config is not None and kv_config.num_blocks:
            block_bytes = sum(t.size_bytes for t in kv_config.tensors) // kv_config.num_blocks
        return ProbeReport(
            counts=[self.sizes.get(r, 0) for r in self.order],
            peak_running=self.peak_running,
            used_blocks_at_peak=self.used_at_peak,
            total_blocks=self.total_blocks,
            block_bytes=block_bytes,
            peak_finished=self.peak_finished,
        )


def output_size(out: Any) -> int:
    """Generated tokens of a RequestOutput (first completion), or pooled vectors of a
    PoolingRequestOutput (1 for an embedding)."""
    completions = getattr(out, "outputs", None)
    if isinstance(completions, list):
        return len(completions[0].token_ids) if completions else 0
    data = getattr(completions, "data", None)
    if data is None:
        return 0
    return 1 if data.ndim == 1 else int(data.shape[0])


def generated_counts(sequences: torch.Tensor, prompt_len: int, eos_token_id: int) -> list[int]:
    """New tokens per row of a `generate` output whose first `prompt_len` columns are the
    prompt: up to and including the first EOS (what follows it is padding), else all."""
    new = sequences[:, prompt_len:]
    width = new.shape[1]
    is_eos = new == eos_token_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, width)
    return first.tolist()


def compare_counts(
    ours: Sequence[int], theirs: Sequence[int] | None, expected: int | None
) -> list[str]:
    """Problems found in per-input output sizes: ours against transformers' (when it ran) and
    against the forced size `expected` (when given). Empty: all agree."""
    problems = []
    if theirs is not None:
        if len(ours) != len(theirs):
            problems.append(
                f"{len(ours)} outputs from v1-engine vs {len(theirs)} from transformers"
            )
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:
                problems.append(f"input {i}: v1-engine {a} vs transformers {b}")
    if expected is not None:
        off = [i for i, a in enumerate(ours) if a != expected]
        if off:
            problems.append(f"v1-engine: {len(off)} inputs without {expected} (first: {off[0]})")
    if not ours:
        problems.append("v1-engine produced no outputs")
    return problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])
