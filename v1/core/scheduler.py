"""The token-budget scheduler: no prefill or decode phases.

Each request has `num_computed_tokens` and a target (`num_tokens`); a step hands out at most
`max_num_batched_tokens` tokens within `max_num_seqs`, running requests first, then waiting ones.
Encoder inputs have their own per-step budget and cache capacity. Out of KV blocks, held
requests (finished beam steps kept for forks, `v1.core.forks`) are freed first, then the lowest
priority running request is preempted by recompute (its self AND cross blocks are freed).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from v1.config import EngineConfig
from v1.core.encoder_cache import EncoderCacheManager
from v1.core.forks import ForkManager
from v1.core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    now,
)
from v1.core.request import Request, RequestStatus
from v1.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from v1.kv_cache.manager import KVCacheManager
from v1.kv_cache.spec import KVCacheConfig


class RequestQueue:
    """Waiting requests. fcfs: groups (EngineCoreRequest.group_id) take turns, each group's
    requests in arrival order, so one client's many sequences share the queue with everyone
    else instead of queueing ahead (with one request per group this is plain FIFO).
    priority: a heap ordered by (priority, arrival). Preempted requests go back in front (fcfs:
    their group first) or by their priority."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._groups: OrderedDict[str, deque[Request]] = OrderedDict()
        self._heap: list[Request] = []
        self._len = 0

    def add(self, request: Request) -> None:
        self._len += 1
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
            return
        group = self._groups.get(request.group_id)
        if group is None:
            group = self._groups[request.group_id] = deque()
        group.append(request)

    def add_front(self, request: Request) -> None:
        if self.policy == "priority":
            self.add(request)
            return
        self._len += 1
        group = self._groups.get(request.group_id)
        if group is None:
            group = self._groups[request.group_id] = deque()
        group.appendleft(request)
        self._groups.move_to_end(request.group_id, last=False)

    def pop(self) -> Request:
        """The next request; its group (fcfs) moves behind the others."""
        self._len -= 1
        if self.policy == "priority":
            return heapq.heappop(self._heap)
        group_id, group = next(iter(self._groups.items()))
        request = group.popleft()
        if group:
            self._groups.move_to_end(group_id)
        else:
            del self._groups[group_id]
        return request

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            group = self._groups[request.group_id]
            group.remove(request)
            if not group:
                del self._groups[request.group_id]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "priority":
            return iter(sorted(self._heap))
        return (r for group in self._groups.values() for r in group)


MAX_SKIPS_PER_STEP = 16
"""Waiting requests that cannot run now which one step looks past for ones that can."""
MAX_TIMES_PASSED = 64
"""Steps a waiting request may be overtaken; after that nothing overtakes it (no starvation)."""


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        sc = config.scheduler_config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.num_scheduler_steps = sc.num_scheduler_steps
        self.policy = sc.policy
        self.max_model_len = config.model_config.effective_max_model_len
        self.encoder_budget = config.encoder_budget
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=config.cache_config.enable_prefix_caching,
        )
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.forks = ForkManager()
        """Finished `hold_kv` requests whose KV blocks wait for forks."""
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_encoder_runs = 0
        self.num_encoder_lookups = 0
        self.num_cross_cache_hits = 0
        """Admissions that attached to cross K/V already in the cache (no encoder, no write)."""
        self.num_held_evictions = 0
        """Held requests freed for room (their forks compute their tokens again)."""

    # ---- request lifecycle ----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stale = self.forks.evict(request.request_id)  # a held request of the same id: gone
        if stale is not None:
            self.kv_cache_manager.free(stale)
        if request.fork_from is not None:
            self.forks.register(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or fail) requests wherever they are; unknown or finished ids are ignored,
        except held ones, which are released (freed once no fork waits for them)."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                self.release_held(req_id)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def release_held(self, req_id: str) -> None:
        """No further fork of `req_id` will come: a held request is freed once the forks that
        registered are admitted (unknown or live ids are ignored)."""
        self._free_held(self.forks.release(req_id))

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache.free(request)
        if request.fork_from is not None:  # ended while waiting to fork
            self._free_held(self.forks.unregister(request))
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _hold(self, request: Request) -> None:
        """A finished `hold_kv` request: its blocks stay (full ones registered in the prefix
        cache) for the requests that fork from it; everything else goes as for a finish."""
        self.kv_cache_manager.cache_computed_blocks(request)
        self.encoder_cache.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.forks.hold(request)

    def _free_held(self, requests: list[Request]) -> None:
        for request in requests:
            self.kv_cache_manager.free(request)

    def _evict_held(self) -> bool:
        """Frees the oldest held request for room; False when none is held."""
        request = self.forks.evict_oldest()
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        self.num_held_evictions += 1
        return True

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_unscheduled_requests(self) -> bool:
        """Some request has tokens not yet scheduled (not every running one is in flight)."""
        return len(self.waiting) > 0 or any(r.num_schedulable_tokens > 0 for r in self.running)

    @property
    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    # ---- scheduling ----
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        budget = _StepBudget(self.max_num_batched_tokens, self.encoder_budget)
        scheduled_running: list[Request] = []
        new_block_ids: list[tuple[list[int], ...] | None] = []
        """Per scheduled running request: the blocks its tables gained, or None."""
        preempted: list[Request] = []
        kv_cache_manager = self.kv_cache_manager
        allocate_slots = kv_cache_manager.allocate_slots
        no_new_blocks = kv_cache_manager.NO_NEW_BLOCKS
        num_scheduled = budget.num_scheduled
        tokens_left = budget.tokens  # budget.tokens, kept local in the loop

        for request in list(self.running):
            if tokens_left == 0:
                break
            if preempted and request in preempted:
                continue
            num_new = request.num_schedulable_tokens
            if num_new > tokens_left:
                num_new = tokens_left
            if num_new == 0:
                continue  # everything it can run is in flight (pipelined scheduling)
            if request.num_computed_tokens + num_new <= request.num_kv_slots:
                new_blocks = no_new_blocks  # allocate_slots' answer, without the call
            else:
                while True:
                    new_blocks = allocate_slots(request, num_new, defer_caching=True)
                    if new_blocks is not None:
                        break
                    if self._evict_held():
                        continue
                    victim = self._pick_victim()
                    if victim in scheduled_running:
                        k = scheduled_running.index(victim)
                        del scheduled_running[k], new_block_ids[k]
                        tokens_left += num_scheduled.pop(victim.request_id)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if new_blocks is None:
                    continue
            scheduled_running.append(request)
            if new_blocks is no_new_blocks:
                new_block_ids.append(None)
            else:
                block_ids = new_blocks.get_block_ids()
                new_block_ids.append(block_ids if any(block_ids) else None)
            # budget.take, inlined: this loop runs for every running request each step.
            num_scheduled[request.request_id] = num_new
            tokens_left -= num_new
        budget.tokens = tokens_left
        kv_cache_manager.cache_deferred_blocks()

        scheduled_new: list[Request] = []
        if not preempted:
            scheduled_new = self._schedule_waiting(budget)
        num_steps = 1
        if self.num_scheduler_steps > 1 and scheduled_running and not scheduled_new:
            num_steps = self._decode_burst(scheduled_running, new_block_ids, num_scheduled)

        return self._make_output(budget, scheduled_running, new_block_ids, scheduled_new, num_steps)

    def _decode_burst(
        self,
        scheduled: list[Request],
        new_block_ids: list[tuple[list[int], ...] | None],
        num_scheduled: dict[str, int],
    ) -> int:
        """Decode steps this step may run back to back (see num_scheduler_steps): 1 unless
        every scheduled request decodes one token with nothing that reads its tokens between
        steps; at most what max_model_len leaves each request. Slots for them are allocated
        here (the new blocks join `new_block_ids`); out of blocks, the step runs one."""
        num_steps = self.num_scheduler_steps
        for request in scheduled:
            params = request.sampling_params
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            if (
                num_scheduled[request.request_id] != 1
                or params is None
                or params.structured_outputs is not None
                or params.word_timestamps
                or request.num_computed_tokens + 1 != num_tokens
            ):
                return 1
            # Tokens past max_tokens are computed and dropped when read back (the request ends
            # at its limit), which lets requests of staggered lengths finish in one burst;
            # max_model_len bounds the KV slots.
            room = self.max_model_len - num_tokens
            if room < num_steps:
                num_steps = room
                if num_steps <= 1:
                    return 1
        allocate_slots = self.kv_cache_manager.allocate_slots
        for k, request in enumerate(scheduled):
            if request.num_computed_tokens + num_steps <= request.num_kv_slots:
                continue
            blocks = allocate_slots(request, num_steps, defer_caching=True)
            if blocks is None:
                num_steps = 1  # blocks taken so far stay with their requests (sent below)
                break
            added = blocks.get_block_ids()
            if any(added):
                old = new_block_ids[k]
                new_block_ids[k] = (
                    added if old is None else tuple(a + b for a, b in zip(old, added, strict=True))
                )
        self.kv_cache_manager.cache_deferred_blocks()
        return num_steps

    def _schedule_waiting(self, budget: _StepBudget) -> list[Request]:
        """Admits waiting requests in queue order while the budgets last. One that cannot run
        now (no room in the step budgets, the encoder cache or the KV cache) is passed over for
        later ones that can, at most MAX_SKIPS_PER_STEP per step; once a request has been
        overtaken MAX_TIMES_PASSED times nothing passes it, so it runs as room frees up."""
        scheduled: list[Request] = []
        skipped: list[tuple[Request, int]] = []
        """Requests passed over, each with how many were admitted before it was."""
        while len(self.waiting) and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.pop()
            if self._try_admit(request, budget):
                scheduled.append(request)
                continue
            skipped.append((request, len(scheduled)))
            if len(skipped) >= MAX_SKIPS_PER_STEP or request.num_times_passed >= MAX_TIMES_PASSED:
                break
        for request, num_before in reversed(skipped):
            if len(scheduled) > num_before:
                request.num_times_passed += 1
            self.waiting.add_front(request)
        return scheduled

    def _try_admit(self, request: Request, budget: _StepBudget) -> bool:
        """Moves `request` (already taken off the queue) to running with its first chunk in
        this step; False, changing nothing, when it cannot run now. Out of KV blocks, it frees
        held requests for room first."""
        while True:
            admitted = self._admit(request, budget)
            if admitted is not None:
                return admitted
            if not self._evict_held():
                return False

    def _admit(self, request: Request, budget: _StepBudget) -> bool | None:
        """One admission attempt of _try_admit: None, changing nothing, when the KV cache has
        too few free blocks."""
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
        if num_new > budget.tokens and (request.is_pooling or not self.enable_chunked_prefill):
            return False  # pooling inputs run whole; without chunking a prompt waits for room
        num_new = min(num_new, budget.tokens)
        run_encoder = False
        # Cross K/V of this encoder input already in the cache (another reader holds them, or
        # they are cached from an earlier one): attach, neither encode nor project again. A
        # word_timestamps request still takes the encoder path: its alignment pass needs the
        # encoder output itself, which the runner keeps from the first step.
        params = request.sampling_params
        wants_encoder_output = params is not None and params.word_timestamps
        cross_cached = (
            request.encoder_input is not None  # no lookup for the many requests without one
            and not wants_encoder_output
            and self.kv_cache_manager.has_encoder_entry(request)
        )
        if request.encoder_input is not None and not cross_cached:
            run_encoder = not self.encoder_cache.has(request.encoder_hash)
            if run_encoder and (
                request.num_encoder_tokens > budget.encoder_tokens
                or not self.encoder_cache.can_allocate(request.num_encoder_tokens)
            ):
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
            self._free_held(self.forks.unregister(request))
        if request.encoder_input is not None:
            self.num_encoder_lookups += 1
            if cross_cached:
                self.num_cross_cache_hits += 1
            elif run_encoder:
                self.encoder_cache.allocate(request)
                budget.encoder_tokens -= request.num_encoder_tokens
                budget.encoder_hashes_to_run[request.encoder_hash] = request.request_id
                self.num_encoder_runs += 1
            else:
                self.encoder_cache.add_ref(request)
            if not cross_cached:
                budget.encoder_reqs.append(request.request_id)
        request.status = RequestStatus.RUNNING
        request.admitted_step = self.num_steps
        request.num_computed_tokens = num_cached
        request.num_times_passed = 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        self.running.append(request)
        budget.take(request, num_new)
        return True

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

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.encoder_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # tokens in flight are dropped and sampled again
        request.num_preemptions += 1
        self.num_preemptions += 1
        # The runner drops its copy; the request comes back as a new one with all its tokens.
        self.finished_req_ids.add(request.request_id)
        self.waiting.add_front(request)

    def _make_output(
        self,
        budget: _StepBudget,
        scheduled_running: list[Request],
        new_block_ids: list[tuple[list[int], ...] | None],
        scheduled_new: list[Request],
        num_steps: int = 1,
    ) -> SchedulerOutput:
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                pooling_params=r.pooling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                encoder_input=r.encoder_input,
                token_type_ids=r.token_type_ids,
                eos_token_id=r.eos_token_id,
            )
            for r in scheduled_new
        ]
        # Running requests' deltas; each then advances (below) past its scheduled tokens.
        num_scheduled = budget.num_scheduled
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
        )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,  # the budget ends with this step
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            encoder_reqs=budget.encoder_reqs,
            encoder_hashes_to_run=budget.encoder_hashes_to_run,
            free_encoder_hashes=self.encoder_cache.take_freed_hashes(),
            step_id=self.num_steps,
            num_decode_steps=num_steps,
            finished_req_ids=self.finished_req_ids,
            block_copies=self.kv_cache_manager.take_block_copies(),
        )
        self.finished_req_ids = set()
        # A request's encoder output is read once, by its first step (the cross-attention
        # pre-step), which is launched before the next schedule(); the entry stays cached (for
        # n>1 children, repeated inputs and resumes) but no longer holds room in the encoder
        # cache, so running requests are not capped by its capacity.
        for req_id in budget.encoder_reqs:
            self.encoder_cache.free(self.requests[req_id])
        # Advance now so the next schedule() sees these tokens as in flight; a step that
        # reaches the end of a generating request samples one token the next step may feed
        # (spelled out: request.num_tokens_with_placeholders, request.is_pooling).
        # num_scheduled holds the running requests in scheduled order, then the new ones.
        scheduled = scheduled_running + scheduled_new
        if num_steps > 1:  # a decode burst: each request samples num_steps tokens
            for request in scheduled_running:
                request.num_computed_tokens += num_steps
                request.num_output_placeholders += num_steps
            return output
        for request, num in zip(scheduled, num_scheduled.values(), strict=True):
            request.num_computed_tokens += num
            if (
                request.pooling_params is None
                and request.num_computed_tokens
                == len(request.all_token_ids) + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1
        return output

    # ---- results ----
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        running = RequestStatus.RUNNING
        sampled_token_ids = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        logprob_token_ids = runner_output.logprob_token_ids
        logprob_ranks = runner_output.logprob_ranks
        extras = runner_output.extras
        req_ids = list(scheduler_output.num_scheduled_tokens)
        pooler_output = runner_output.pooler_output
        pooled: list[Request] = []
        """Pooling requests of the step: each ends with its result."""
        index = None  # the runner's rows follow the schedule's order (checked once per step)
        if req_ids != runner_output.req_ids:
            index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        step_id = scheduler_output.step_id
        for row, req_id in enumerate(req_ids):
            request = requests.get(req_id)
            if request is None or request.status != running or request.admitted_step > step_id:
                continue  # aborted or preempted while the step ran (and maybe admitted again)
            i = row if index is None else index[req_id]
            if request.pooling_params is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                result = pooler_output[i] if pooler_output else None
                outputs.append(
                    EngineCoreOutput(
                        req_id, [], pooled_output=result, finish_reason=FinishReason.STOP
                    )
                )
                pooled.append(request)
                continue
            new_ids = sampled_token_ids[i]
            if not new_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            num_placeholders = request.num_output_placeholders - len(new_ids)
            request.num_output_placeholders = num_placeholders if num_placeholders > 0 else 0
            new_ids = self._append_and_check_stop(request, new_ids)
            status = request.status
            lp_token_ids = lp_values = lp_ranks = None
            if logprobs is not None and logprobs[i] is not None:
                # The first len(new_ids) rows; the runner's lists themselves when they hold no
                # more (nothing writes to them after the step).
                n = len(new_ids)
                lp_token_ids = logprob_token_ids[i]  # type: ignore[index]
                lp_values = logprobs[i]
                lp_ranks = logprob_ranks[i]  # type: ignore[index]
                if len(lp_token_ids) != n:
                    lp_token_ids = lp_token_ids[:n]
                if len(lp_values) != n:
                    lp_values = lp_values[:n]
                if len(lp_ranks) != n:
                    lp_ranks = lp_ranks[:n]
            # EngineCoreOutput's fields in order (positional: it is built per request and step).
            out = EngineCoreOutput(
                req_id,
                new_ids,
                lp_token_ids,
                lp_values,
                lp_ranks,
                None,
                None if status == running else RequestStatus.finish_reason(status),
                request.stop_reason,
                None,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            )
            if extras:
                request_extras = extras.get(req_id)
                if request_extras:
                    out.extras = request_extras
            outputs.append(out)
            if status != running:
                self._finish(request)
        if pooled:
            self._finish_all(pooled)
        return EngineCoreOutputs(outputs=outputs, timestamp=now())

    def _append_and_check_stop(self, request: Request, new_ids: list[int]) -> list[int]:
        """Appends the sampled tokens up to the first that ends the request (its status says
        why); returns those accepted (`new_ids` itself when all are: nothing writes to the
        runner's lists after the step)."""
        params = request.sampling_params
        output_token_ids = request.output_token_ids
        all_token_ids = request.all_token_ids
        num_accepted = 0
        for token in new_ids:
            output_token_ids.append(token)  # request.append_output_token_ids, per token
            all_token_ids.append(token)
            num_accepted += 1
            if len(output_token_ids) >= params.min_tokens:
                if token == request.eos_token_id and not params.ignore_eos:
                    request.status = RequestStatus.FINISHED_STOPPED
                    break
                if params.stop_token_ids and token in params.stop_token_ids:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token
                    break
            if (
                len(output_token_ids) >= request.max_tokens
                or len(all_token_ids) >= self.max_model_len
            ):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        return new_ids if num_accepted == len(new_ids) else new_ids[:num_accepted]

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)

    def _finish_all(self, requests: list[Request]) -> None:
        """Finished `requests`, all running, leave `running` in one pass: a pooling step ends
        ~100 requests at once, where a list.remove each scans `running` again."""
        done = set(map(id, requests))
        self.running[:] = [r for r in self.running if id(r) not in done]
        for request in requests:
            self._release(request)

    def _release(self, request: Request) -> None:
        """A finished request's resources: held for forks (hold_kv), else freed."""
        if request.hold_kv and request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            self._hold(request)
        else:
            self._free_request(request)

    # ---- stats ----
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.num_total_blocks - kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            num_preemptions=self.num_preemptions,
            num_encoder_runs=self.num_encoder_runs,
            num_encoder_lookups=self.num_encoder_lookups,
            num_cross_cache_hits=self.num_cross_cache_hits,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_forks=kv.num_forks,
            num_forked_tokens=kv.num_forked_tokens,
            num_block_copies=kv.num_block_copies,
            num_held_evictions=self.num_held_evictions,
        )


class _StepBudget:
    """What is left of one step's token and encoder budgets, and what was handed out."""

    def __init__(self, tokens: int, encoder_tokens: int) -> None:
        self.tokens = tokens
        self.encoder_tokens = encoder_tokens
        self.num_scheduled: dict[str, int] = {}
        self.encoder_reqs: list[str] = []
        self.encoder_hashes_to_run: dict[str, str] = {}

    def take(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.tokens -= num_tokens
