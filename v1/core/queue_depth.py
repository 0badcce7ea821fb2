"""How much of a batch a frontend must keep queued for the scheduler to choose each step as it
would with the whole batch queued, so that a batch fed in as the steps go runs the same steps
(hence the same results, to the bit) as one queued at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from v1.config import EngineConfig
from v1.core.scheduler.admitter import MAX_SKIPS_PER_STEP


@dataclass(frozen=True)
class PoolingQueueDepth:
    """Unfinished pooling requests (queued or running) enough for the next `schedule`.

    One step's scan of the waiting queue admits at most `max_num_seqs` less the running
    requests, holding at most `max_num_batched_tokens` tokens, and stops at its
    MAX_SKIPS_PER_STEP-th pass over a request that does not fit. A pooling request runs from its
    admission until its step is read back, so the running ones belong to the steps in flight
    (each at most one token budget). Either bound below therefore leaves more waiting requests
    than any scan can reach. With data parallelism each engine needs as much (the requests are
    spread over them, so the steps are not those of one engine anyway).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    steps_in_flight: int
    """Launched steps not read back when the next one is scheduled (0: synchronous steps)."""
    num_engines: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> PoolingQueueDepth:
        sc = config.scheduler_config
        return cls(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            steps_in_flight=sc.max_steps_in_flight - 1 if config.use_async_scheduling else 0,
            num_engines=config.parallel_config.data_parallel_size,
        )

    def reached(
        self,
        num_requests: int,
        num_tokens: int,
        max_input_len: int,
        steps_in_flight: int | None = None,
    ) -> bool:
        """Whether `num_requests` unfinished requests of `num_tokens` tokens in all, none
        longer than `max_input_len`, are enough. `steps_in_flight`: a tighter bound on the
        steps in flight at the next schedule than the pipeline's depth (a batch's first
        steps, before the pipeline fills)."""
        n = self.num_engines
        if num_requests >= n * (self.max_num_seqs + MAX_SKIPS_PER_STEP):
            return True
        in_flight = self.steps_in_flight
        if steps_in_flight is not None:
            in_flight = min(steps_in_flight, in_flight)
        budgets = (in_flight + 1) * self.max_num_batched_tokens
        return num_tokens >= n * (budgets + MAX_SKIPS_PER_STEP * max_input_len)
