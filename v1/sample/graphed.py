"""The fixed-shape sampler: a step's logits, rules, argmax, logprobs and Whisper timestamp state
as one CUDA graph replay, reading every per-request input from `SamplingState`'s slot-indexed
device tensors (static addresses) and three int64 numbers per row (slot, flags, forced token).
Same tokens, logprobs and ranks as the general Sampler; steps with a rule it lacks
(`SamplingState.needs_general_sampler`), prompt logprobs or a grammar take that one instead."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from v1.logger import init_logger
from v1.sample.sampler import SamplerOutput, gather_logprobs
from v1.sample.state import SamplingState
from v1.sample.states.token_tables import apply_forced_tokens, token_mask
from v1.sample.states.whisper_timestamps import whisper_timestamp_rules_

logger = init_logger(__name__)

_NEG_INF = float("-inf")

# Bits of a row's flags.
VALID = 1
"""The row samples a token that counts (its step reached the end of the known tokens)."""
FIRST = 2
"""No output token yet (begin_suppress_tokens, Whisper's first timestamp)."""
UNDER_MIN = 4
"""Fewer outputs than min_tokens: its stop ids are banned."""
TIMESTAMPS = 8
"""Whisper timestamp rules on."""

GraphKey = tuple[int, int | None, bool, bool, tuple[int, int, int]]
"""(padded rows, max logprobs or None, timestamps, forced tokens, ban table widths)."""


def dense_sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    flags: torch.Tensor,
    forced: torch.Tensor | None,
    state: SamplingState,
    num_logprobs: int | None,
    timestamps: bool,
) -> SamplerOutput:
    """One token per row of `logits` [n, vocab]: row i belongs to `slots[i]` with `flags[i]`
    and `forced[i]` (-1: none). Fixed kernel sequence (what a CUDA graph captures). Updates the
    Whisper timestamp state of VALID rows with TIMESTAMPS in place."""
    if logits.is_cuda and not timestamps and num_logprobs in (None, 0):
        return _fused_greedy(logits, _banned(logits, slots, flags, state), forced, num_logprobs)
    logits = logits.to(torch.float32, copy=True)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if num_logprobs is not None else None
    first = (flags & FIRST) != 0
    is_ts = (flags & TIMESTAMPS) != 0
    banned = _banned(logits, slots, flags, state)
    if banned is not None:
        logits.masked_fill_(banned, _NEG_INF)
    if timestamps:
        rows = torch.arange(len(slots), device=logits.device)
        rule_inputs = state.timestamps.rule_metadata(slots, rows, first)
        whisper_timestamp_rules_(logits, rule_inputs, active=is_ts)
    if forced is not None:
        apply_forced_tokens(logits, forced)
    sampled = logits.argmax(dim=-1)
    if timestamps:
        ts = state.timestamps
        writes = ((flags & VALID) != 0) & is_ts
        # Rows that must not write write the spare row (a fixed-shape scatter).
        ts.state_dev[torch.where(writes, slots, ts.spare_row)] = ts.next_state(
            ts.state_dev[slots], sampled, ~first
        )
    if raw_logprobs is None:
        return SamplerOutput(sampled_token_ids=sampled)
    assert num_logprobs is not None
    token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, num_logprobs, sampled)
    return SamplerOutput(sampled, token_ids, logprobs, ranks)


def _banned(
    logits: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor, state: SamplingState
) -> torch.Tensor | None:
    """[n, vocab] bool: each row's suppress_tokens, begin_suppress_tokens on its first step and
    min_tokens' stop ids while under min_tokens (None when no table has a column)."""
    bans = []
    tables = state.token_tables
    if tables.suppress_token_ids.dev.shape[1]:
        bans.append(tables.suppress_token_ids.dev[slots])
    for table, active in (
        (tables.begin_suppress_token_ids, (flags & FIRST) != 0),
        (tables.min_tokens_stop_ids, (flags & UNDER_MIN) != 0),
    ):
        if table.dev.shape[1]:
            bans.append(torch.where(active.unsqueeze(1), table.dev[slots], -1))
    return token_mask(torch.cat(bans, dim=1), logits.shape[1]) if bans else None


def _fused_greedy(
    logits: torch.Tensor,
    banned: torch.Tensor | None,
    forced: torch.Tensor | None,
    num_logprobs: int | None,
) -> SamplerOutput:
    """The rules, argmax and the sampled token's logprob in one kernel over the 16-bit logits
    (`triton_greedy.py`), for steps without timestamp rules or top-N logprobs."""
    from v1.sample.triton_greedy import greedy_sample

    sampled, logprob, rank = greedy_sample(logits, banned, forced, num_logprobs is not None)
    if num_logprobs is None:
        return SamplerOutput(sampled_token_ids=sampled)
    return SamplerOutput(sampled, sampled.unsqueeze(1), logprob, rank)


def row_inputs(
    state: SamplingState, slots: np.ndarray, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """(flags [n], forced tokens [n] or None) of a step's rows, from host-known counts."""
    num_output = state.num_output_tokens[slots]
    flags = valid.astype(np.int64) * VALID
    flags += (num_output == 0) * FIRST
    flags += (num_output < state.token_tables.min_tokens[slots]) * UNDER_MIN
    flags += state.timestamps.enabled[slots] * TIMESTAMPS
    return flags, state.token_tables.forced_tokens_at(slots, num_output)


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 32 past it, and `max_rows`."""
    sizes = [s for s in (1, 2, 4) if s < max_rows]
    sizes += list(range(8, min(max_rows, 256), 8)) + list(range(256, max_rows, 32))
    return sorted(set(sizes + [max_rows]))


class SamplerGraphs:
    """CUDA graphs of `compute_logits` + `dense_sample`, one per key, captured when a key is
    first needed (the common ones at start-up: `capture_common`) in one private memory pool.
    Off CUDA the same steps run the function eagerly (tests drive this path on CPU).

    Static inputs: `hidden` [max_rows, H] (the rows to sample from, copied in by one kernel)
    and `rows` [3 * max_rows] int64, laid out per graph size P as [slots | flags | forced], each
    P long, written by one pinned copy per step."""

    def __init__(
        self,
        state: SamplingState,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden_size: int,
        dtype: torch.dtype,
        max_rows: int,
    ) -> None:
        self.state = state
        self.compute_logits = compute_logits
        self.max_rows = max_rows
        self.sizes = capture_sizes(max_rows)
        device = state.device
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
        self.rows = torch.zeros(3 * max_rows, dtype=torch.int64, device=device)
        self.graphs: dict[
            GraphKey, tuple[torch.cuda.CUDAGraph | None, Callable[[], SamplerOutput]]
        ] = {}
        """Key -> (graph, its outputs); off CUDA (tests) no graph and the function itself."""
        self.pool = None
        self.num_replays = 0
        self.num_captures = 0

    def widths(self) -> tuple[int, int, int]:
        tables = self.state.token_tables
        return (
            tables.suppress_token_ids.dev.shape[1],
            tables.begin_suppress_token_ids.dev.shape[1],
            tables.min_tokens_stop_ids.dev.shape[1],
        )

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rows[:size], self.rows[size : 2 * size], self.rows[2 * size : 3 * size]

    @torch.inference_mode()
    def capture(
        self, key: GraphKey
    ) -> tuple[torch.cuda.CUDAGraph | None, Callable[[], SamplerOutput]]:
        size, num_logprobs, timestamps, has_forced, _ = key
        slots, flags, forced = self._views(size)
        # Neutral inputs: slot 0, no flags (nothing VALID: no state write), nothing forced.
        self.rows[: 3 * size].zero_()
        forced.fill_(-1)

        def run() -> SamplerOutput:
            logits = self.compute_logits(self.hidden[:size])
            return dense_sample(
                logits,
                slots,
                flags,
                forced if has_forced else None,
                self.state,
                num_logprobs,
                timestamps,
            )

        if not self.rows.is_cuda:
            self.graphs[key] = (None, run)
            return self.graphs[key]
        run()  # warm-up outside the capture (lazy inits, kernel selection)
        torch.cuda.synchronize(self.state.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, lambda: out)
        self.num_captures += 1
        return self.graphs[key]

    def capture_common(self, num_logprobs: list[int | None], timestamps: list[bool]) -> None:
        """Every size for these signatures (no forced tokens), before the first step."""
        if not self.rows.is_cuda:
            return
        widths = self.widths()
        for size in reversed(self.sizes):
            for k in num_logprobs:
                for ts in timestamps:
                    self.capture((size, k, ts, False, widths))
        logger.info(
            "captured %d sampler graphs (rows up to %d, logprobs %s, timestamps %s)",
            len(self.graphs),
            self.max_rows,
            num_logprobs,
            timestamps,
        )

    def run(
        self,
        hidden_states: torch.Tensor,
        logits_indices: torch.Tensor,
        slots: np.ndarray,
        valid: np.ndarray,
    ) -> SamplerOutput | None:
        """Samples the step's rows (hidden_states[logits_indices], of `slots`) by replaying
        a graph; None when a row needs the general Sampler. `valid`: rows whose token counts.
        The outputs are views of the graph's buffers, valid until its next replay (which
        stream order puts after every read of them enqueued before it)."""
        state = self.state
        num_rows = len(slots)
        assert logits_indices.shape[0] == num_rows, "one logits row per request"
        if num_rows > self.max_rows or bool(state.needs_general_sampler[slots].any()):
            return None
        max_logprobs = int(state.params.num_logprobs[slots].max(initial=-1))
        timestamps = state.timestamps.info is not None and bool(
            state.timestamps.enabled[slots].any()
        )
        flags, forced = row_inputs(state, slots, valid)
        state.flush()  # tables current before the key reads their widths
        size = next(s for s in self.sizes if s >= num_rows)
        key = (
            size,
            max_logprobs if max_logprobs >= 0 else None,
            timestamps,
            forced is not None,
            self.widths(),
        )
        entry = self.graphs.get(key)
        if entry is None:
            if key[4] != next(iter(self.graphs), key)[4]:
                self.graphs.clear()  # a ban table grew: graphs of the old tables are stale
            entry = self.capture(key)
        graph, outputs = entry
        packed = np.zeros((3, size), dtype=np.int64)
        packed[0, :num_rows] = slots
        packed[1, :num_rows] = flags
        packed[2] = -1
        if forced is not None:
            packed[2, :num_rows] = forced
        host = torch.from_numpy(packed.reshape(-1))
        if self.rows.is_cuda:
            host = host.pin_memory()
        self.rows[: 3 * size].copy_(host, non_blocking=True)
        torch.index_select(hidden_states, 0, logits_indices, out=self.hidden[:num_rows])
        if graph is not None:
            graph.replay()
        out = outputs()  # the graph's output buffers (off CUDA: the function runs now)
        self.num_replays += 1
        return SamplerOutput(
            out.sampled_token_ids[:num_rows],
            None if out.logprob_token_ids is None else out.logprob_token_ids[:num_rows],
            None if out.logprobs is None else out.logprobs[:num_rows],
            None if out.ranks is None else out.ranks[:num_rows],
        )
