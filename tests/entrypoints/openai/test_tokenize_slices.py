"""A huge prompt batch is tokenized a slice at a time on the one input thread, so a small
request's tokenization runs between two slices instead of after the whole batch (issue 36:
2048 long prompts delayed a 5-token completion from 0.5 to 11 s). Ordering, not timing."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from v1.entrypoints.openai.serving_completions import TOKENIZE_SLICE, ServingCompletions


def test_small_request_tokenizes_between_slices_of_a_huge_batch() -> None:
    serving = object.__new__(ServingCompletions)
    pool = ThreadPoolExecutor(1)  # the engine's input thread: one task at a time
    order: list[tuple[int, int]] = []
    first_slice_running, go = threading.Event(), threading.Event()

    async def offload(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, partial(fn, *args))

    def tokenize(items: list[Any], start: int, total: int, truncate: int | None) -> list[Any]:
        if total > 1 and start == 0:
            first_slice_running.set()
            go.wait(10)
        order.append((total, start))
        return list(items)

    serving.offload = offload  # type: ignore[method-assign]
    serving._tokenize_items = tokenize  # type: ignore[method-assign]
    num_big = 10 * TOKENIZE_SLICE

    async def main() -> tuple[list[Any], list[Any]]:
        big = asyncio.create_task(serving._completion_prompts([[1, 2]] * num_big, None))
        while not first_slice_running.is_set():
            await asyncio.sleep(0.001)
        small = asyncio.create_task(serving._completion_prompts("hi", None))
        await asyncio.sleep(0.01)  # the small request's task is queued behind slice 0
        go.set()
        return await big, await small

    try:
        big_out, small_out = asyncio.run(main())
    finally:
        pool.shutdown()
    assert len(big_out) == num_big and small_out == ["hi"]
    assert order[0] == (num_big, 0)
    assert order[1] == (1, 0), order[:3]  # the small request right after the first slice
    assert [start for total, start in order if total == num_big] == list(
        range(0, num_big, TOKENIZE_SLICE)
    )
