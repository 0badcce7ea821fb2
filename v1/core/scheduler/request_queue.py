"""`RequestQueue`: the waiting requests in admission order, fcfs (fair turns between groups) or
by priority; preempted requests go back in front.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator

from v1.core.request import Request


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
        self.group_sizes: Counter[str] = Counter()
        """Waiting requests per group (both policies; read by the fair share)."""

    def add(self, request: Request) -> None:
        self._len += 1
        self.group_sizes[request.group_id] += 1
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
        self._add_to_group_front(request)
        self._groups.move_to_end(request.group_id, last=False)

    def requeue(self, request: Request) -> None:
        """A request preempted to make room for other groups: first of its group again, but
        its group keeps its turn (fcfs) instead of going before everyone."""
        if self.policy == "priority":
            self.add(request)
            return
        self._add_to_group_front(request)

    def _add_to_group_front(self, request: Request) -> None:
        self._len += 1
        self.group_sizes[request.group_id] += 1
        group = self._groups.get(request.group_id)
        if group is None:
            group = self._groups[request.group_id] = deque()
        group.appendleft(request)

    def pop(self) -> Request:
        """The next request; its group (fcfs) moves behind the others."""
        self._len -= 1
        if self.policy == "priority":
            request = heapq.heappop(self._heap)
        else:
            group_id, group = next(iter(self._groups.items()))
            request = group.popleft()
            if group:
                self._groups.move_to_end(group_id)
            else:
                del self._groups[group_id]
        self._forget(request.group_id)
        return request

    def _forget(self, group_id: str) -> None:
        if self.group_sizes[group_id] <= 1:
            del self.group_sizes[group_id]
        else:
            self.group_sizes[group_id] -= 1

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
        self._forget(request.group_id)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "priority":
            return iter(sorted(self._heap))
        return (r for group in self._groups.values() for r in group)
