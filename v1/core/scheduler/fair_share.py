"""`FairShare`: each group (EngineCoreRequest.group_id: one client request, its `n` children
included) gets a fair share of the running batch, max(1, max_num_seqs // active groups), while
other groups wait. A group over its share yields running slots (preempted by recompute, latest
admitted first) to waiting groups under theirs, so a waiting request is admitted the next step
its token and KV budgets allow, however many sequences another client started first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from v1.core.request import Request
from v1.core.scheduler.request_queue import RequestQueue

MAX_DEFERRED = 1024
"""Waiting requests of groups at their share one admission pass looks past (bounds its work)."""


@dataclass(frozen=True)
class ShareState:
    """One step's view of the groups while some group under its share waits."""

    share: int
    """Running slots each active group (running or waiting) is entitled to."""
    num_running: Counter[str]
    """Running requests per group."""
    capped: frozenset[str]
    """Groups at or over their share: the admitter takes their waiting requests only after
    everyone else's (they still fill slots nobody else can use)."""
    num_needy: int
    """Waiting groups under their share."""


class FairShare:
    def __init__(self, max_num_seqs: int, policy: str) -> None:
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.num_fair_preemptions = 0
        """Running requests preempted to give a waiting group its share."""

    def state(self, running: list[Request], waiting: RequestQueue) -> ShareState | None:
        """None when no group under its share waits, or no running group has more than one
        request (then nobody is over a share): the common case costs one pass over running."""
        if not len(waiting) or not running:
            return None
        num_running = Counter(r.group_id for r in running)
        if len(num_running) == len(running):
            return None
        waiting_groups = waiting.group_sizes
        num_groups = len(waiting_groups) + sum(1 for g in num_running if g not in waiting_groups)
        share = max(1, self.max_num_seqs // num_groups)
        capped = frozenset(g for g, n in num_running.items() if n >= share)
        num_needy = len(waiting_groups) - sum(1 for g in capped if g in waiting_groups)
        if num_needy == 0:
            return None
        return ShareState(share, num_running, capped, num_needy)

    def pick_victims(
        self, running: list[Request], waiting: RequestQueue, state: ShareState
    ) -> list[Request]:
        """Running requests to preempt so that each needy group finds a free slot: from the
        group furthest over its share, its latest admitted first. Under the priority policy a
        victim never has a higher priority (lower value) than the request it makes room for."""
        num_missing = state.num_needy - (self.max_num_seqs - len(running))
        if num_missing <= 0:
            return []
        beneficiaries = self._needy_heads(waiting, state, num_missing)
        num_running = Counter(state.num_running)
        victims: list[Request] = []
        for beneficiary in beneficiaries:
            victim = self._victim(running, num_running, state.share, beneficiary, victims)
            if victim is None:
                break
            victims.append(victim)
            num_running[victim.group_id] -= 1
        self.num_fair_preemptions += len(victims)
        return victims

    def _needy_heads(self, waiting: RequestQueue, state: ShareState, limit: int) -> list[Request]:
        """The first waiting request of up to `limit` needy groups, in queue order."""
        heads: list[Request] = []
        seen: set[str] = set()
        for request in waiting:
            group = request.group_id
            if group in seen or group in state.capped:
                continue
            seen.add(group)
            heads.append(request)
            if len(heads) == limit:
                break
        return heads

    def _victim(
        self,
        running: list[Request],
        num_running: Counter[str],
        share: int,
        beneficiary: Request,
        taken: list[Request],
    ) -> Request | None:
        over = sorted(
            (g for g, n in num_running.items() if n > share), key=lambda g: -num_running[g]
        )
        for group in over:
            for request in reversed(running):
                if request.group_id != group or request in taken:
                    continue
                if self.policy == "priority" and request.priority < beneficiary.priority:
                    continue
                return request
        return None
