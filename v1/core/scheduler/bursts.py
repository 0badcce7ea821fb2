"""Decode bursts (SchedulerConfig.num_scheduler_steps): one engine step runs up to K decode
steps back to back when every scheduled request decodes one token and nothing reads its tokens
between steps. Their KV slots are allocated up front; max_model_len bounds K; tokens past
max_tokens are computed and dropped when read back (the request ends at its limit).
"""

from __future__ import annotations

from v1.core.scheduler.step_plan import StepPlan
from v1.kv_cache.manager import KVCacheManager


def burst_length(
    plan: StepPlan, num_scheduler_steps: int, max_model_len: int, streamed_ok: bool = True
) -> int:
    """Decode steps the plan's running requests may run back to back: 1 unless every one
    decodes one token (no prefill chunk, grammar or word timestamps) and, unless
    `streamed_ok`, none is streamed; at most what max_model_len leaves each request."""
    num_steps = num_scheduler_steps
    num_scheduled = plan.num_scheduled
    for request in plan.scheduled_running:
        params = request.sampling_params
        num_tokens = len(request.all_token_ids) + request.num_output_placeholders
        if (
            num_scheduled[request.request_id] != 1
            or params is None
            or params.structured_outputs is not None
            or params.word_timestamps
            or request.num_computed_tokens + 1 != num_tokens
            or (request.streamed and not streamed_ok)
        ):
            return 1
        # Requests of staggered lengths may finish inside one burst; only the KV slots bound it.
        room = max_model_len - num_tokens
        if room < num_steps:
            num_steps = room
            if num_steps <= 1:
                return 1
    return num_steps


def allocate_burst(plan: StepPlan, num_steps: int, kv_cache_manager: KVCacheManager) -> int:
    """Allocates the KV slots of `num_steps` decode steps for the plan's running requests (the
    new blocks join `plan.new_block_ids`); returns `num_steps`, or 1 when out of blocks (blocks
    taken so far stay with their requests and are sent)."""
    allocate_slots = kv_cache_manager.allocate_slots
    new_block_ids = plan.new_block_ids
    for k, request in enumerate(plan.scheduled_running):
        if request.num_computed_tokens + num_steps <= request.num_kv_slots:
            continue  # allocate_slots' answer (no new blocks), without the call
        blocks = allocate_slots(request, num_steps, defer_caching=True)
        if blocks is None:
            num_steps = 1
            break
        added = blocks.get_block_ids()
        if any(added):
            old = new_block_ids[k]
            new_block_ids[k] = (
                added if old is None else tuple(a + b for a, b in zip(old, added, strict=True))
            )
    kv_cache_manager.cache_deferred_blocks()
    return num_steps
