"""The KV cache's share of a GPU (`kv_cache_bytes`): gpu_memory_utilization is one engine's own
budget, as in vLLM, so another engine's memory on the device does not count against it; the
KV cache still never takes more than is free."""

from __future__ import annotations

import pytest

from v1.worker.gpu_memory import MemoryBaseline, kv_cache_bytes

GIB = 1 << 30
TOTAL = 140 * GIB


def share(
    *,
    others: float,
    utilization: float,
    own_non_torch: float = 0.5,
    peak: float = 2.0,
    allocated: float = 1.0,
) -> int:
    """An engine whose weights and profiling step peaked at `peak` GiB (`allocated` GiB of it
    still allocated, `peak` reserved), beside `others` GiB another process held at its start."""
    baseline = MemoryBaseline(non_torch=int(others * GIB))
    reserved = int(peak * GIB)
    used = int((others + own_non_torch) * GIB) + reserved
    return kv_cache_bytes(
        utilization=utilization,
        total=TOTAL,
        free=TOTAL - used,
        reserved=reserved,
        allocated=int(allocated * GIB),
        peak=int(peak * GIB),
        baseline=baseline,
    )


def test_an_engine_alone_gets_its_share_less_its_own_memory() -> None:
    assert share(others=0.0, utilization=0.9) == int(0.9 * TOTAL) - int(2.5 * GIB)


def test_a_second_engine_on_the_device_gets_the_same_share() -> None:
    # The first engine at 0.425 holds ~59.5 GiB: the second's budget is its own 0.425.
    alone = share(others=0.0, utilization=0.425)
    beside = share(others=0.425 * 140, utilization=0.425)
    assert beside == alone > 50 * GIB


def test_the_cache_takes_no_more_than_is_free() -> None:
    # 100 GiB held elsewhere: a 0.9 budget (~123 GiB) does not fit; what is free does.
    got = share(others=100.0, utilization=0.9)
    free_and_cached = TOTAL - int(100.5 * GIB) - int(2.0 * GIB) + int(2.0 * GIB) - GIB
    assert got == free_and_cached < int(0.9 * TOTAL) - int(2.5 * GIB)


def test_nothing_left_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.01"):
        share(others=0.0, utilization=0.01, peak=2.0)
    with pytest.raises(ValueError, match="other processes hold 137.50 GiB"):
        share(others=137.5, utilization=0.9, allocated=2.0)
