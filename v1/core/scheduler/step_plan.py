"""`StepPlan`: what one schedule() hands out, built by the step loop, the admitter and decode
bursts, then turned into the `SchedulerOutput`. `tokens` and `encoder_tokens` are what is left
of the step's budgets; `num_scheduled` holds running requests in scheduled order, then new ones.
"""

from __future__ import annotations

from v1.core.request import Request


class StepPlan:
    def __init__(self, tokens: int, encoder_tokens: int) -> None:
        self.tokens = tokens
        self.encoder_tokens = encoder_tokens
        self.num_scheduled: dict[str, int] = {}
        """req_id -> tokens it computes this step."""
        self.scheduled_running: list[Request] = []
        self.new_block_ids: list[tuple[list[int], ...] | None] = []
        """Per scheduled running request: the blocks its tables gained, or None."""
        self.scheduled_new: list[Request] = []
        self.encoder_reqs: list[str] = []
        """Admitted requests whose encoder output (computed or cached) feeds cross-attention."""
        self.encoder_hashes_to_run: dict[str, str] = {}
        """Encoder content hash -> the request whose input the runner encodes this step."""
        self.num_decode_steps = 1
        """Decode steps run back to back (a decode burst when > 1)."""
        self.pooled_inputs = 0
        """Inputs of the pooling requests admitted (each packed input counts): at most
        max_num_seqs, the sequences the runner's step buffers hold."""

    def take(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.tokens -= num_tokens
