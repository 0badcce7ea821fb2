"""`Scheduler`, the step loop: no prefill or decode phases. Each request has computed vs total
tokens; a step hands out at most max_num_batched_tokens within max_num_seqs, running requests
first, then waiting ones (the admitter); a group over its fair share of the batch yields slots to
waiting groups (fair_share). Out of KV blocks, held requests are freed first, then
the lowest-priority running request is preempted by recompute (all its blocks freed).
"""

from __future__ import annotations

from collections.abc import Iterable

from v1.config import EngineConfig
from v1.core.encoder_cache import EncoderCacheManager
from v1.core.forks import ForkManager
from v1.core.protocol import EngineCoreOutputs, SchedulerStats
from v1.core.request import Request, RequestStatus
from v1.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from v1.core.scheduler.admitter import Admitter
from v1.core.scheduler.bursts import allocate_burst, burst_length
from v1.core.scheduler.fair_share import FairShare
from v1.core.scheduler.output_stage import OutputStage
from v1.core.scheduler.request_queue import RequestQueue
from v1.core.scheduler.resources import RequestResources
from v1.core.scheduler.step_plan import StepPlan
from v1.kv_cache.manager import KVCacheManager
from v1.kv_cache.spec import KVCacheConfig


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        sc = config.scheduler_config
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.num_scheduler_steps = sc.num_scheduler_steps
        self.bursts_take_streamed = not config.auto_num_scheduler_steps
        """A user's num_scheduler_steps bursts every request; the auto one only those nobody
        reads token by token (EngineCoreRequest.streamed)."""
        self.num_decode_bursts = 0
        self.policy = sc.policy
        self.max_model_len = config.model_config.effective_max_model_len
        self.encoder_budget = config.encoder_budget
        self.encoder_step_budget = config.encoder_step_budget
        self.encoder_input_len = config.model_config.max_encoder_len
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
        """Shared with the admitter and the output stage: changed in place, never rebound."""
        self.resources = RequestResources(
            self.kv_cache_manager, self.encoder_cache, self.forks, self.requests
        )
        self.admitter = Admitter(config, self.waiting, self.running, self.resources)
        self.fair_share = FairShare(sc.max_num_seqs, self.policy)
        self.output_stage = OutputStage(self.running, self.resources, self.max_model_len)
        self.num_preemptions = 0
        self.num_steps = 0

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
                self.resources.release_held(req_id)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.resources.free(request)
            finished.append(request)
        return finished

    def release_held(self, req_id: str) -> None:
        """No further fork of `req_id` will come (see RequestResources.release_held)."""
        self.resources.release_held(req_id)

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_unscheduled_requests(self) -> bool:
        """Some request has tokens not yet scheduled (not every running one is in flight)."""
        return len(self.waiting) > 0 or any(r.num_schedulable_tokens > 0 for r in self.running)

    @property
    def has_finished_requests(self) -> bool:
        return bool(self.resources.finished_req_ids)

    @property
    def finished_req_ids(self) -> set[str]:
        """Finished or preempted since the last step (sent with the next SchedulerOutput)."""
        return self.resources.finished_req_ids

    # ---- scheduling ----
    def _encoder_tokens(self) -> int:
        """This step's encoder budget: the whole `encoder_budget` while more inputs wait than
        `encoder_step_budget` holds (they would wait a step each otherwise), else the latter."""
        if len(self.waiting) * self.encoder_input_len > self.encoder_step_budget:
            return self.encoder_budget
        return self.encoder_step_budget

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        plan = StepPlan(self.max_num_batched_tokens, self._encoder_tokens())
        capped: frozenset[str] = frozenset()
        shares = self.fair_share.state(self.running, self.waiting)
        if shares is not None:
            capped = shares.capped
            for victim in self.fair_share.pick_victims(self.running, self.waiting, shares):
                self._preempt(victim, requeue=True)
        preempted = self._schedule_running(plan)
        if not preempted:
            self.admitter.admit_waiting(plan, self.num_steps, capped)
        if self.num_scheduler_steps > 1 and plan.scheduled_running and not plan.scheduled_new:
            num_steps = burst_length(
                plan, self.num_scheduler_steps, self.max_model_len, self.bursts_take_streamed
            )
            if num_steps > 1:
                plan.num_decode_steps = allocate_burst(plan, num_steps, self.kv_cache_manager)
                self.num_decode_bursts += plan.num_decode_steps > 1
        return self._make_output(plan)

    def _schedule_running(self, plan: StepPlan) -> bool:
        """Schedules running requests in order, each its schedulable tokens within the budget;
        out of KV blocks, frees held requests, then preempts victims (maybe ones scheduled
        already, or the request itself). Returns whether any request was preempted."""
        scheduled = plan.scheduled_running
        new_block_ids = plan.new_block_ids
        num_scheduled = plan.num_scheduled
        preempted: list[Request] = []
        allocate_slots = self.kv_cache_manager.allocate_slots
        no_new_blocks = self.kv_cache_manager.NO_NEW_BLOCKS
        tokens_left = plan.tokens  # kept local in the loop: it runs for every running request
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
                    if self.resources.evict_held():
                        continue
                    victim = self._pick_victim()
                    if victim in scheduled:
                        k = scheduled.index(victim)
                        del scheduled[k], new_block_ids[k]
                        tokens_left += num_scheduled.pop(victim.request_id)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if new_blocks is None:
                    continue
            scheduled.append(request)
            if new_blocks is no_new_blocks:
                new_block_ids.append(None)
            else:
                block_ids = new_blocks.get_block_ids()
                new_block_ids.append(block_ids if any(block_ids) else None)
            num_scheduled[request.request_id] = num_new  # plan.take, inlined
            tokens_left -= num_new
        plan.tokens = tokens_left
        self.kv_cache_manager.cache_deferred_blocks()
        return bool(preempted)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _preempt(self, request: Request, requeue: bool = False) -> None:
        """`requeue`: preempted for another group's share, it waits first in its group but
        keeps its group's turn (else it goes back first in the queue)."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.encoder_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # tokens in flight are dropped and sampled again
        request.num_preemptions += 1
        self.num_preemptions += 1
        # The runner drops its copy; the request comes back as a new one with all its tokens.
        self.resources.finished_req_ids.add(request.request_id)
        if requeue:
            self.waiting.requeue(request)
        else:
            self.waiting.add_front(request)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
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
                input_lens=r.input_lens,
                eos_token_id=r.eos_token_id,
                lora_request=r.lora_request,
            )
            for r in plan.scheduled_new
        ]
        # Running requests' deltas; each then advances (_advance) past its scheduled tokens.
        scheduled_running = plan.scheduled_running
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=plan.new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
        )
        num_scheduled = plan.num_scheduled
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,  # the plan ends with this step
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            encoder_reqs=plan.encoder_reqs,
            encoder_hashes_to_run=plan.encoder_hashes_to_run,
            free_encoder_hashes=self.encoder_cache.take_freed_hashes(),
            step_id=self.num_steps,
            num_decode_steps=plan.num_decode_steps,
            finished_req_ids=self.resources.take_finished_req_ids(),
            block_copies=self.kv_cache_manager.take_block_copies(),
        )
        # A request's encoder output is read once, by its first step (the cross-attention
        # pre-step), launched before the next schedule(); the entry stays cached (for n>1
        # children, repeated inputs and resumes) but no longer holds room in the encoder cache,
        # so running requests are not capped by its capacity.
        for req_id in plan.encoder_reqs:
            self.encoder_cache.free(self.requests[req_id])
        _advance(plan)
        return output

    # ---- results ----
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        return self.output_stage.update_from_output(scheduler_output, runner_output)

    # ---- stats ----
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        admitter = self.admitter
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.num_total_blocks - kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            num_preemptions=self.num_preemptions,
            num_encoder_runs=admitter.num_encoder_runs,
            num_encoder_lookups=admitter.num_encoder_lookups,
            num_cross_cache_hits=admitter.num_cross_cache_hits,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_forks=kv.num_forks,
            num_forked_tokens=kv.num_forked_tokens,
            num_block_copies=kv.num_block_copies,
            num_held_evictions=self.resources.num_held_evictions,
            num_decode_bursts=self.num_decode_bursts,
        )


def _advance(plan: StepPlan) -> None:
    """Moves each scheduled request past its scheduled tokens now, so the next schedule() sees
    them in flight: a step that reaches the end of a generating request's known and in-flight
    tokens samples one token the next step may feed (a placeholder until read back)."""
    if plan.num_decode_steps > 1:  # a decode burst: each request samples num_steps tokens
        num_steps = plan.num_decode_steps
        for request in plan.scheduled_running:
            request.num_computed_tokens += num_steps
            request.num_output_placeholders += num_steps
        return
    # num_scheduled holds the running requests in scheduled order, then the new ones.
    scheduled = plan.scheduled_running + plan.scheduled_new
    for request, num in zip(scheduled, plan.num_scheduled.values(), strict=True):
        request.num_computed_tokens += num
        if (
            request.pooling_params is None
            and request.num_computed_tokens
            == len(request.all_token_ids) + request.num_output_placeholders
        ):
            request.num_output_placeholders += 1
