"""`RequestFeed`: an offline batch's requests handed to the engine in input order as its steps
need them (`LLM._run`): a window of unfinished requests for generation, a queue depth and
packed requests for pooling.
"""

from __future__ import annotations

from typing import Any

from v1.core.queue_depth import PoolingQueueDepth
from v1.engine.inputs.encoder_only import UncheckedIdsError
from v1.engine.llm_engine import LLMEngine
from v1.lora_request import LoRARequest

PRETOKENIZE_CHUNK = 64
"""Pooling prompts tokenized together (the feed processes prompts as the steps need them)."""


class RequestFeed:
    """A batch's requests, handed to the engine in input order as its steps need them.

    Generation (`window`): every prompt is validated before any is queued, so a long run cannot
    fail at its last prompt; then at most `window` requests are unfinished at a time.
    Pooling (`pooling_depth`): each request is one step of work, so the batch is processed as
    it goes: each top-up processes and adds prompts only until the unfinished ones are enough
    for the next step's scheduling to choose as with the whole batch queued. The device starts
    on the first step's inputs at once, the rest of the processing overlaps the steps, and
    the steps, hence the results, are those of the batch queued at once. An invalid prompt
    raises ValueError (naming it) when its turn comes, and the caller aborts what was queued.
    """

    def __init__(
        self,
        engine: LLMEngine,
        items: list[tuple[str, Any, Any, int]],
        *,
        window: int | None = None,
        pooling_depth: PoolingQueueDepth | None = None,
        loras: list[LoRARequest | None] | None = None,
        pack: tuple[int, int] | None = None,
    ) -> None:
        """`items`: (request id, prompt, params, priority) in input order; exactly one of
        `window` and `pooling_depth`. `pack` (pooling): consecutive inputs with equal params
        go to the core as packed requests of at most (tokens, inputs) each."""
        assert (window is None) != (pooling_depth is None)
        self.engine = engine
        self.items = items
        self.window = window
        self.pooling_depth = pooling_depth
        self.pack = pack if pack is not None and pack[1] > 1 else None
        self.pack_of: dict[str, str] = {}
        """Packed inputs' request ids -> their core request's."""
        self.loras = loras
        """Per item: the LoRA adapter it runs with (None: all run the base model)."""
        self.processed: list[list[Any] | None] = [None] * len(items)
        """Core requests of prompts processed but not added yet."""
        self.to_build = [prompt for _, prompt, _, _ in items]
        """The prompts as `process_request` takes them (pooling: pretokenized a chunk ahead)."""
        self.num_pretokenized = 0
        self.next = 0
        self.unfinished: dict[str, int] = {}
        """Added requests (packed ones by their core request id) without a final output ->
        their tokens."""
        self.unfinished_tokens = 0
        self.max_input_len = 0
        """The most tokens of one added request."""
        self.top_ups = 0
        """Top-ups so far: in this process each is followed by one engine step, which
        schedules at most one step, so at most this many steps are in flight at the next
        schedule (a core in its own process runs ahead of the feed: no such bound)."""
        self.in_process = not engine.core_runs_ahead
        if window is not None:
            for i in range(len(items)):
                self.processed[i] = self._process(i)

    def top_up(self) -> None:
        """Adds the next requests until the unfinished ones are enough (or none are left)."""
        with self.engine.batched_adds():  # one message per core per top-up
            self._top_up()
        self.top_ups += 1

    def _top_up(self) -> None:
        engine, items = self.engine, self.items
        while self.next < len(items) and not self._enough():
            if self.pack is not None:
                self._add_pack()
                continue
            i = self.next
            core_requests = self.processed[i]
            if core_requests is None:
                core_requests = self._process(i)
            self.processed[i] = None
            for request in core_requests:
                # One call is one client's batch: one fair-share group (the scheduler's fair
                # shares are between clients, not between the prompts of one batch).
                request.group_id = items[0][0]
            req_id, prompt, params, _ = items[i]
            engine.add_processed_request(req_id, prompt, params, core_requests)
            self.next = i + 1
            self._added(req_id, sum(len(r.prompt_token_ids) for r in core_requests))

    def _add_pack(self) -> None:
        """Adds the next inputs with equal params as one packed core request, up to the pack's
        tokens and inputs."""
        assert self.pack is not None
        max_tokens, max_inputs = self.pack
        items, processed = self.items, self.processed
        first = self.next
        params = items[first][2]
        pack: list[tuple[str, list[int], list[int] | None]] = []
        tokens = 0
        while self.next < len(items) and len(pack) < max_inputs:
            i = self.next
            entry = processed[i]
            if entry is None:
                entry = self._pooling_input(i)
            processed[i] = None
            n = len(entry[0])
            other = items[i][2]
            if pack and (tokens + n > max_tokens or (other is not params and other != params)):
                processed[i] = entry  # it starts the next pack
                break
            pack.append((items[i][0], *entry))
            tokens += n
            self.next = i + 1
        core_id = f"{pack[0][0]}+{len(pack)}"
        try:
            # One call is one client's batch: one fair-share group.
            self.engine.add_packed_request(core_id, pack, params, group_id=items[0][0])
        except UncheckedIdsError as e:
            if len(items) == 1:
                raise
            raise ValueError(f"prompt {first + e.index}: {e}") from e
        for req_id, _, _ in pack:
            self.pack_of[req_id] = core_id
        self._added(core_id, tokens)

    def _pooling_input(self, i: int) -> Any:
        """Item i's (input ids, segment ids), for a pack (validated a chunk ahead)."""
        if i >= self.num_pretokenized:
            end = min(i + PRETOKENIZE_CHUNK, len(self.items))
            params = [item[2] for item in self.items[i:end]]
            self.to_build[i:end] = self.engine.pooling_inputs(self.to_build[i:end], params)
            self.num_pretokenized = end
        entry = self.to_build[i]
        self.to_build[i] = None  # its tokens live on in the entry
        if isinstance(entry, ValueError):
            if len(self.items) == 1:
                raise entry
            raise ValueError(f"prompt {i}: {entry}") from entry
        return entry

    def _added(self, core_id: str, tokens: int) -> None:
        self.unfinished[core_id] = tokens
        self.unfinished_tokens += tokens
        self.max_input_len = max(self.max_input_len, tokens)

    def finished(self, req_id: str) -> None:
        """`req_id` (added) has its final output (a packed core request: at its first
        input's)."""
        core_id = self.pack_of.pop(req_id, req_id)
        tokens = self.unfinished.pop(core_id, None)
        if tokens is not None:
            self.unfinished_tokens -= tokens

    def _enough(self) -> bool:
        if self.pooling_depth is not None:
            # The first step starts on its own budget, not the pipeline's: the device gets
            # to work after a third of the processing (3 steps in flight).
            in_flight = self.top_ups if self.in_process else None
            return self.pooling_depth.reached(
                len(self.unfinished), self.unfinished_tokens, self.max_input_len, in_flight
            )
        return len(self.unfinished) >= self.window

    def _process(self, i: int) -> list[Any]:
        req_id, _, params, priority = self.items[i]
        if self.pooling_depth is not None and i >= self.num_pretokenized:
            end = min(i + PRETOKENIZE_CHUNK, len(self.items))
            self.to_build[i:end] = self.engine.pretokenize(self.to_build[i:end])
            self.num_pretokenized = end
        try:
            lora = self.loras[i] if self.loras is not None else None
            core_requests = self.engine.process_request(
                req_id, self.to_build[i], params, priority, lora
            )
        except ValueError as e:
            if len(self.items) == 1:
                raise
            raise ValueError(f"prompt {i}: {e}") from e
        self.to_build[i] = None  # its tokens live on in the request
        return core_requests
