"""The token-budget scheduler as named parts: the step loop with preemption (`scheduler`), the
admitter, decode bursts, the output stage, and the queue, step plan and resources they share.
`SchedulerOutput` is its only contract with the worker; `Scheduler` is its API.
"""

from v1.core.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
