"""`Admitter`: which waiting requests enter this step (mini-sglang's prefill adder), within the
step's token, sequence and encoder budgets, the encoder cache and the KV cache. A request that
cannot run now is passed over for later ones at most MAX_SKIPS_PER_STEP times a step, and is
never overtaken once passed MAX_TIMES_PASSED times (no starvation). Groups at their fair share
(fair_share.py) are admitted after the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from v1.config import EngineConfig
from v1.core.encoder_cache import EncoderCacheManager
from v1.core.request import Request, RequestStatus
from v1.core.scheduler.fair_share import MAX_DEFERRED
from v1.core.scheduler.request_queue import RequestQueue
from v1.core.scheduler.resources import RequestResources
from v1.core.scheduler.step_plan import StepPlan
from v1.kv_cache.manager import KVCacheManager

MAX_SKIPS_PER_STEP = 16
"""Waiting requests that cannot run now which one step looks past for ones that can."""
MAX_TIMES_PASSED = 64
"""Steps a waiting request may be overtaken; after that nothing overtakes it (no starvation)."""


@dataclass(frozen=True)
class _EncoderPlan:
    """How an admitted request gets its encoder output."""

    cross_cached: bool
    """Its cross K/V are in the KV cache already: attach, neither encode nor project."""
    run_encoder: bool
    """Not in the encoder cache: the runner encodes it this step."""


_NO_ENCODER = _EncoderPlan(cross_cached=False, run_encoder=False)


class Admitter:
    def __init__(
        self,
        config: EngineConfig,
        waiting: RequestQueue,
        running: list[Request],
        resources: RequestResources,
    ) -> None:
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.enable_chunked_prefill = config.scheduler_config.enable_chunked_prefill
        self.waiting = waiting
        self.running = running
        self.resources = resources
        self.kv_cache_manager: KVCacheManager = resources.kv_cache_manager
        self.encoder_cache: EncoderCacheManager = resources.encoder_cache
        self.forks = resources.forks
        lora = config.lora_config
        self.max_loras = lora.max_loras if lora.enable_lora else 0
        """Distinct adapters running requests may use together (the worker's device slots)."""
        self.num_encoder_runs = 0
        self.num_encoder_lookups = 0
        self.num_cross_cache_hits = 0
        """Admissions that attached to cross K/V already in the cache (no encoder, no write)."""

    def admit_waiting(
        self, plan: StepPlan, step_id: int, capped: frozenset[str] = frozenset()
    ) -> None:
        """Admits waiting requests in queue order while the budgets last (into
        `plan.scheduled_new`), passing over those that cannot run now. Requests of `capped`
        groups (at their fair share, see FairShare) come after everyone else's."""
        scheduled = plan.scheduled_new
        skipped: list[tuple[Request, int]] = []
        """Requests passed over, each with how many were admitted before it was."""
        deferred: list[Request] = []
        popped: list[Request] = []
        """Everything taken off the queue in order (what is not admitted goes back so)."""
        while len(self.waiting) and plan.tokens > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.pop()
            popped.append(request)
            if request.group_id in capped:
                deferred.append(request)
                if len(deferred) >= MAX_DEFERRED:
                    break
                continue
            if self._try_admit(request, plan, step_id):
                scheduled.append(request)
                continue
            skipped.append((request, len(scheduled)))
            if len(skipped) >= MAX_SKIPS_PER_STEP or request.num_times_passed >= MAX_TIMES_PASSED:
                break
        # Slots nobody else could take go to the capped groups (the batch stays full).
        for request in deferred:
            if plan.tokens <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self._try_admit(request, plan, step_id):
                break
            scheduled.append(request)
        for request, num_before in skipped:
            if len(scheduled) > num_before:
                request.num_times_passed += 1
        for request in reversed(popped):
            if request.status != RequestStatus.RUNNING:
                self.waiting.add_front(request)

    def _try_admit(self, request: Request, plan: StepPlan, step_id: int) -> bool:
        """Moves `request` (already off the queue) to running with its first chunk in this
        step; False, changing nothing, when it cannot run now. Out of KV blocks, it frees held
        requests for room first."""
        while True:
            admitted = self._admit(request, plan, step_id)
            if admitted is not None:
                return admitted
            if not self.resources.evict_held():
                return False

    def _admit(self, request: Request, plan: StepPlan, step_id: int) -> bool | None:
        """One admission attempt: False when the step budgets or the encoder cache have no
        room, None (changing nothing) when the KV cache has too few free blocks."""
        if not self._lora_fits(request):
            return False
        computed_blocks, num_cached = None, 0
        fork_source = self._fork_source(request)
        if fork_source is not None:
            num_cached = fork_source.num_computed_tokens
        elif (
            request.num_computed_tokens == 0
            and not request.is_pooling
            and request.sampling_params.prompt_logprobs is None  # those need every prompt token
        ):
            computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if num_new > plan.tokens and (request.is_pooling or not self.enable_chunked_prefill):
            return False  # pooling inputs run whole; without chunking a prompt waits for room
        if (
            request.input_lens is not None
            and plan.pooled_inputs + len(request.input_lens) > self.max_num_seqs
        ):
            return False  # its packed inputs would pass the step's sequences
        num_new = min(num_new, plan.tokens)
        encoder = self._encoder_plan(request, plan)
        if encoder is None:
            return False
        if fork_source is not None:
            new_blocks = self.kv_cache_manager.fork_slots(
                request,
                fork_source,
                num_new,
                num_encoder_tokens=request.num_encoder_tokens,
                move_last_block=self.forks.is_last_fork(request),
            )
        else:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_cached,
                new_computed_blocks=computed_blocks,
                num_encoder_tokens=request.num_encoder_tokens,
            )
        if new_blocks is None:
            return None
        if request.fork_from is not None:
            self.resources.free_held(self.forks.unregister(request))
        self._take_encoder(request, plan, encoder)
        request.status = RequestStatus.RUNNING
        request.admitted_step = step_id
        request.num_computed_tokens = num_cached
        request.num_times_passed = 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        self.running.append(request)
        plan.take(request, num_new)
        if request.pooling_params is not None:
            plan.pooled_inputs += request.num_inputs
        return True

    def _lora_fits(self, request: Request) -> bool:
        """A request's adapter is already running or a device slot is left for it."""
        lora_id = request.lora_int_id
        if not lora_id:
            return True
        running = {r.lora_int_id for r in self.running} - {0}
        return lora_id in running or len(running) < self.max_loras

    def _encoder_plan(self, request: Request, plan: StepPlan) -> _EncoderPlan | None:
        """How the request gets its encoder output, or None when it cannot this step (the
        encoder budget or the encoder cache has no room)."""
        if request.encoder_input is None:  # no lookup for the many requests without one
            return _NO_ENCODER
        # A word_timestamps request still takes the encoder path: its alignment pass needs the
        # encoder output itself, which the runner keeps from the first step.
        params = request.sampling_params
        wants_encoder_output = params is not None and params.word_timestamps
        if not wants_encoder_output and self.kv_cache_manager.has_encoder_entry(request):
            return _EncoderPlan(cross_cached=True, run_encoder=False)
        run_encoder = not self.encoder_cache.has(request.encoder_hash)
        if run_encoder and (
            request.num_encoder_tokens > plan.encoder_tokens
            or not self.encoder_cache.can_allocate(request.num_encoder_tokens)
        ):
            return None
        return _EncoderPlan(cross_cached=False, run_encoder=run_encoder)

    def _take_encoder(self, request: Request, plan: StepPlan, encoder: _EncoderPlan) -> None:
        """An admitted request's encoder output: attached, cached, or run this step."""
        if request.encoder_input is None:
            return
        self.num_encoder_lookups += 1
        if encoder.cross_cached:
            self.num_cross_cache_hits += 1
            return
        if encoder.run_encoder:
            self.encoder_cache.allocate(request)
            plan.encoder_tokens -= request.num_encoder_tokens
            plan.encoder_hashes_to_run[request.encoder_hash] = request.request_id
            self.num_encoder_runs += 1
        else:
            self.encoder_cache.add_ref(request)
        plan.encoder_reqs.append(request.request_id)

    def _fork_source(self, request: Request) -> Request | None:
        """The held request whose KV `request` may fork: registered, still held, and holding
        the KV of a prefix of request's tokens over the same encoder input."""
        if request.fork_from is None or request.num_computed_tokens:
            return None
        source = self.forks.source(request)
        if source is None:
            return None
        n = source.num_computed_tokens
        if (
            request.is_pooling
            or request.sampling_params.prompt_logprobs is not None
            or not 0 < n < request.num_tokens
            or source.encoder_hash != request.encoder_hash
            or source.all_token_ids[:n] != request.all_token_ids[:n]
        ):
            return None
        return source
