"""The KV cache's share of a GPU (`kv_cache_bytes`): gpu_memory_utilization is one engine's own
budget, as in vLLM, so another engine's memory on the device does not count against it; a
budget the device cannot hold is a clear error at start-up."""

from __future__ import annotations

import pytest

from v1.worker.gpu_memory import MemoryBaseline, kv_cache_bytes

GIB = 1 << 30
TOTAL = 140 * GIB
CONTEXT = 0.5  # GiB: this process's CUDA context, in the baseline with the others' memory


def share(*, others: float, utilization: float, own_non_torch: float = 0.25, peak: float = 2.0):
    """An engine whose weights and profiling step peaked at `peak` GiB (all of it still
    reserved), beside `others` GiB of other processes when its worker started."""
    baseline = MemoryBaseline(non_torch=int((others + CONTEXT) * GIB))
    reserved = int(peak * GIB)
    used = int((others + CONTEXT + own_non_torch) * GIB) + reserved
    return kv_cache_bytes(
        utilization=utilization,
        total=TOTAL,
        free=TOTAL - used,
        reserved=reserved,
        peak=int(peak * GIB),
        baseline=baseline,
    )


def test_an_engine_alone_gets_its_share_less_its_own_memory() -> None:
    assert share(others=0.0, utilization=0.9) == int(0.9 * TOTAL) - int(2.25 * GIB)


def test_a_second_engine_on_the_device_gets_the_same_share() -> None:
    # The first engine at 0.425 holds ~59.5 GiB: the second's budget is its own 0.425.
    alone = share(others=0.0, utilization=0.425)
    beside = share(others=0.425 * 140, utilization=0.425)
    assert beside == alone > 50 * GIB


def test_the_whole_device_is_cut_to_what_is_free() -> None:
    # At 1.0 the budget passes what is free by the process's own context: cut, not refused.
    got = share(others=0.0, utilization=1.0)
    assert got == TOTAL - int((CONTEXT + 0.25 + 2.0) * GIB)


def test_a_budget_the_device_cannot_hold_is_a_clear_error() -> None:
    # 60 GiB held elsewhere: 0.9 of the device (~123 GiB of KV) cannot fit in ~77 GiB free.
    with pytest.raises(
        ValueError, match=r"60\.50 GiB of its 140\.00 GiB were in use.*lower gpu_memory"
    ):
        share(others=60.0, utilization=0.9)
    assert share(others=60.0, utilization=0.5) == int(0.5 * TOTAL) - int(2.25 * GIB)


def test_nothing_left_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.01"):
        share(others=0.0, utilization=0.01, peak=2.0)
