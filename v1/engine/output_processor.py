"""EngineCoreOutputs -> user outputs: detokenize, stop strings, logprobs, n>1 merge, deltas.

One `RequestState` per core request; a `ParentRequest` merges its n children back into one
RequestOutput. Stop-string hits are returned for aborting in the core. Sample logprobs become
`Logprob` entries only when an output reports them (never for `lazy_logprobs` requests).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from v1.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.engine.detokenizer import IncrementalDetokenizer, make_detokenizer
from v1.logger import init_logger
from v1.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from v1.sampling_params import SamplingParams

logger = init_logger(__name__)

AnyRequestOutput = RequestOutput | PoolingRequestOutput


def logprob_entry(
    ids: list[int], lps: list[float], rank: int, decode: Callable[[int], str | None]
) -> dict[int, Logprob]:
    """{token id: Logprob} of one sampled token: `ids` = [sampled, top-1, ..., top-N] and
    their logprobs; the sampled token keeps its own `rank`, the top ones rank 1..N."""
    sampled = ids[0]
    entry = {sampled: Logprob(lps[0], rank, decode(sampled))}
    if len(ids) > 1 or len(lps) > 1:
        for k, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, k, decode(tid))
    return entry


class LazySampleLogprobs(Sequence[dict[int, Logprob]]):
    """Sample logprobs as the core sent them; an entry is built when it is read. Given to
    requests added with `lazy_logprobs=True`, whose consumer reads `sampled_logprobs()`: the
    sampled tokens' logprobs, without an object per token."""

    def __init__(
        self,
        token_ids: list[list[int]],
        logprobs: list[list[float]],
        ranks: list[int],
        decode: Callable[[int], str | None],
    ) -> None:
        assert len(token_ids) == len(logprobs) == len(ranks)
        self._token_ids, self._logprobs, self._ranks = token_ids, logprobs, ranks
        self._decode = decode

    def sampled_logprobs(self) -> list[float]:
        """Per token: the logprob of the sampled token (its entry's first value)."""
        return [lps[0] for lps in self._logprobs]

    def __len__(self) -> int:
        return len(self._ranks)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return logprob_entry(
            self._token_ids[index], self._logprobs[index], self._ranks[index], self._decode
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class ParentRequest:
    """A user request with n > 1 completions, run as n child requests."""

    request_id: str
    params: SamplingParams
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    """Latest (cumulative) completion per child index."""
    finished_indices: set[int] = field(default_factory=set)
    error: str | None = None
    """The first error a child ended with."""

    @property
    def n(self) -> int:
        return self.params.n

    @staticmethod
    def child_request_id(index: int, parent_id: str) -> str:
        return f"{index}_{parent_id}"

    @property
    def child_ids(self) -> list[str]:
        return [self.child_request_id(i, self.request_id) for i in range(self.n)]

    @property
    def finished(self) -> bool:
        return len(self.finished_indices) == self.n

    def child_params(self, index: int) -> SamplingParams:
        """n=1 params of child `index`; a seeded parent gives child i the seed `seed + i` so the
        completions differ but stay reproducible."""
        seed = self.params.seed
        return self.params.clone(n=1, seed=None if seed is None else seed + index)


@dataclass(slots=True)
class RequestState:
    """What the frontend keeps for one request the core runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    """None for pooling requests."""
    parent: ParentRequest | None = None
    index: int = 0
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_logprobs: int | None = None
    lazy_logprobs: bool = False
    """Report sample logprobs as a `LazySampleLogprobs` view of what the core sent instead of
    built entries: for consumers that read only the sampled tokens' values (transcription
    windows)."""
    logprobs: SampleLogprobs = field(default_factory=list)
    """The entries built so far (none for a lazy_logprobs request); `cumulative_logprob` sums
    their sampled tokens."""
    raw_ids: list[list[int]] = field(default_factory=list)
    """Per token whose logprobs are not in `logprobs` yet (for a lazy_logprobs request: every
    token): its `new_logprob_token_ids` item. Entries (Logprob objects, decoded token strings)
    are built only when a completion reports them (a FINAL_ONLY request: once, at the end), not
    per token per step. The rows are the output's own lists: nothing writes to them after the
    step (the scheduler's contract)."""
    raw_lps: list[list[float]] = field(default_factory=list)
    """The matching `new_logprobs` items."""
    raw_ranks: list[int] = field(default_factory=list)
    """The matching `new_logprob_ranks` items."""
    num_summed: int = 0
    """lazy_logprobs: the raw tokens `cumulative_logprob` has summed (in arrival order)."""
    prompt_logprobs: PromptLogprobs | None = None
    """Set with the first token of a request with prompt_logprobs."""
    queue_time: float | None = None
    """From the core's first output of the request."""
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
    sent_tokens: int = 0
    """Tokens (and logprobs) already reported in DELTA mode."""
    extras: dict[str, float | list[float]] = field(default_factory=dict)
    """Model-specific per-request results from the core (Whisper: no_speech_prob)."""
    packed: list[tuple[str, list[int]]] | None = None
    """A core request packing several pooling inputs (EngineCoreRequest.input_lens): per
    input, its user request id and prompt token ids. Its one core output becomes one user
    output per input (EmbeddingRequestOutputs for task embed: no base output to convert)."""
    pooling_task: str | None = None

    @property
    def user_request_id(self) -> str:
        return self.parent.request_id if self.parent is not None else self.request_id


class OutputProcessor:
    """Frontend state of every running request (single process, not thread-safe)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._decoded_tokens: dict[int, str] = {}

    # ---- bookkeeping ----
    def add_user_request(
        self,
        request_id: str,
        core_requests: list[EngineCoreRequest],
        params: Any,
        texts: tuple[str | None, str | None],
        *,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lazy_logprobs: bool = False,
    ) -> None:
        """Tracks one user request's core requests: its n > 1 samples under one
        `ParentRequest`. `texts`: (prompt, encoder prompt) as the outputs report them."""
        parent = None
        if isinstance(params, SamplingParams) and params.n > 1:
            parent = ParentRequest(request_id, params)
        for index, request in enumerate(core_requests):
            self.add_request(
                request,
                texts[0],
                parent,
                index,
                output_kind=output_kind,
                encoder_prompt=texts[1],
                lazy_logprobs=lazy_logprobs,
            )

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        request_index: int = 0,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        encoder_prompt: str | None = None,
        lazy_logprobs: bool = False,
    ) -> None:
        """Tracks a request sent to the core; children of an n>1 request pass their parent.
        `lazy_logprobs`: its completions carry `LazySampleLogprobs` (see RequestState)."""
        req_id = request.request_id
        if req_id in self.request_states:
            raise ValueError(f"request id {req_id!r} is already in use")
        params = request.sampling_params
        detokenizer = None
        if params is not None:
            detokenizer = make_detokenizer(
                self.tokenizer,
                params,
                request.prompt_token_ids,
                final_only=output_kind == RequestOutputKind.FINAL_ONLY,
            )
        enc = request.encoder_input
        # A pooling request's ids are the built request's own list, which nothing changes
        # (the core keeps it as sent too): its output shares it instead of a copy.
        prompt_token_ids = request.prompt_token_ids
        if params is not None:
            prompt_token_ids = list(prompt_token_ids)
        self.request_states[req_id] = RequestState(
            request_id=req_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            output_kind=output_kind,
            detokenizer=detokenizer,
            parent=parent,
            index=request_index,
            encoder_prompt=encoder_prompt,
            encoder_prompt_token_ids=enc.token_ids if enc is not None else None,
            num_logprobs=params.logprobs if params is not None else None,
            lazy_logprobs=lazy_logprobs,
        )
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def add_packed_request(
        self, request: EngineCoreRequest, inputs: list[tuple[str, list[int]]]
    ) -> None:
        """Tracks a core request packing several pooling inputs: `inputs` holds each one's
        user request id and prompt token ids, in packing order."""
        req_id = request.request_id
        if req_id in self.request_states:
            raise ValueError(f"request id {req_id!r} is already in use")
        self.request_states[req_id] = RequestState(
            req_id,
            None,
            request.prompt_token_ids,
            RequestOutputKind.FINAL_ONLY,
            None,
            packed=inputs,
            pooling_task=request.pooling_params.task,
        )

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets user requests (parents included); returns the core request ids to abort.
        Aborted requests produce no further output."""
        core_ids: list[str] = []
        for req_id in request_ids:
            parent = self.parent_requests.pop(req_id, None)
            ids = parent.child_ids if parent is not None else [req_id]
            for core_id in ids:
                state = self.request_states.pop(core_id, None)
                if state is None:
                    continue
                core_ids.append(core_id)
                if state.parent is not None and parent is None:
                    # One child aborted alone: it will never finish, so neither will the parent.
                    self._drop_parent_if_idle(state.parent)
        return core_ids

    def _drop_parent_if_idle(self, parent: ParentRequest) -> None:
        if not any(i in self.request_states for i in parent.child_ids):
            self.parent_requests.pop(parent.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """User requests still running (an n>1 request counts once)."""
        return len({s.user_request_id for s in self.request_states.values()})

    # ---- outputs ----
    def process_outputs(
        self, engine_core_outputs: Iterable[EngineCoreOutput]
    ) -> tuple[list[AnyRequestOutput], list[str]]:
        """(user outputs to report now, core request ids to abort: stop-string hits)."""
        results: list[AnyRequestOutput] = []
        reqs_to_abort: list[str] = []
        request_states = self.request_states
        for out in engine_core_outputs:
            state = request_states.get(out.request_id)
            if state is None:
                continue  # aborted, or finished by a stop string while the core ran on
            try:
                self._process_output(state, out, results, reqs_to_abort)
            except Exception:  # noqa: BLE001 - one request's failure ends that request alone
                results.extend(self._fail_request(state, reqs_to_abort))
        return results, reqs_to_abort

    def _fail_request(
        self, state: RequestState, reqs_to_abort: list[str]
    ) -> list[AnyRequestOutput]:
        """Ends the user request of `state` (every child of an n>1 request; every input of a
        packed request) with an error after its output could not be processed; its core
        requests are aborted. The exception goes to the log under an id the error names."""
        error_id = uuid.uuid4().hex
        user_id = state.user_request_id
        logger.exception("processing the output of request %s failed (id: %s)", user_id, error_id)
        for core_id in self.abort_requests([user_id]):
            if core_id not in reqs_to_abort:
                reqs_to_abort.append(core_id)
        error = f"internal error (id: {error_id})"
        if state.detokenizer is None:
            inputs = state.packed or [(user_id, state.prompt_token_ids)]
            return [
                PoolingRequestOutput(
                    request_id=input_id,
                    outputs=None,
                    prompt_token_ids=ids,
                    finished=True,
                    error=error,
                    queue_time=state.queue_time,
                )
                for input_id, ids in inputs
            ]
        return [self._make_request_output(state, user_id, [], True, error)]

    def _process_output(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        results: list[AnyRequestOutput],
        reqs_to_abort: list[str],
    ) -> None:
        request_states = self.request_states
        if out.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.queue_time is not None:
            state.queue_time = out.queue_time
        if out.extras:
            state.extras.update(out.extras)
        detokenizer = state.detokenizer
        if detokenizer is None:
            if state.packed is not None:
                results.extend(self._packed_outputs(state, out))
            else:
                results.append(self._pooling_output(state, out))
            del request_states[out.request_id]
            return
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        num_before = len(detokenizer.token_ids)
        stop_str = detokenizer.update(
            out.new_token_ids, finish_reason is not None and finish_reason == FinishReason.STOP
        )
        lp_ids, lps, lp_ranks = (
            out.new_logprob_token_ids,
            out.new_logprobs,
            out.new_logprob_ranks,
        )
        if stop_str is not None:
            if finish_reason is None:
                reqs_to_abort.append(out.request_id)
            finish_reason, stop_reason = FinishReason.STOP, stop_str
            num_new = len(detokenizer.token_ids) - num_before
            if lps is not None and num_new < len(lps):  # tokens past the stop: dropped
                lp_ids, lps, lp_ranks = lp_ids[:num_new], lps[:num_new], lp_ranks[:num_new]
        if state.num_logprobs is not None and lps is not None:
            assert lp_ids is not None and lp_ranks is not None
            state.raw_ids.extend(lp_ids)
            state.raw_lps.extend(lps)
            state.raw_ranks.extend(lp_ranks)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = self._prompt_logprobs(out)
        finished = finish_reason is not None
        if (
            not finished
            and state.parent is None
            and state.output_kind == RequestOutputKind.FINAL_ONLY
        ):
            return  # the common decode step of a batch run: nothing to report yet
        completion = self._completion(state, finish_reason, stop_reason, finished)
        if finished:
            del request_states[out.request_id]
        result = self._request_output(state, completion, finished, out.error)
        if result is not None:
            results.append(result)

    def _pooling_output(self, state: RequestState, out: EngineCoreOutput) -> PoolingRequestOutput:
        data = PoolingOutput(out.pooled_output) if out.pooled_output is not None else None
        # Positional (the fields in order): one is built per request.
        return PoolingRequestOutput(
            state.request_id, data, state.prompt_token_ids, True, out.error, state.queue_time
        )

    def _packed_outputs(
        self, state: RequestState, out: EngineCoreOutput
    ) -> list[PoolingRequestOutput]:
        """One output per packed input: row i of the pooled results is input i's."""
        assert state.packed is not None
        pooled = out.pooled_output
        error, queue_time = out.error, state.queue_time
        if pooled is None:
            return [
                PoolingRequestOutput(input_id, None, ids, True, error, queue_time)
                for input_id, ids in state.packed
            ]
        if len(pooled) != len(state.packed):
            raise ValueError(f"{len(pooled)} pooled rows for {len(state.packed)} packed inputs")
        if state.pooling_task == "embed" and error is None and pooled.ndim == 2:
            # The final type at once (4096 MiniLM inputs: ~9 ms less than a base output
            # each, converted after).
            return [
                EmbeddingRequestOutput(input_id, EmbeddingOutput(row), ids, True, None, queue_time)
                for (input_id, ids), row in zip(state.packed, pooled, strict=True)
            ]
        return [
            PoolingRequestOutput(input_id, PoolingOutput(row), ids, True, error, queue_time)
            for (input_id, ids), row in zip(state.packed, pooled, strict=True)
        ]

    def _sample_logprobs(self, state: RequestState, start: int) -> SampleLogprobs:
        """The entries of tokens `start`... (a lazy view for a lazy_logprobs request). The new
        tokens are added to `cumulative_logprob` one by one in arrival order: the same float
        sum as adding each as it came."""
        if not state.lazy_logprobs:
            if state.raw_ranks:
                self._build_entries(state)
            return state.logprobs[start:]
        cumulative = state.cumulative_logprob
        for lps in state.raw_lps[state.num_summed :]:
            cumulative += lps[0]
        state.cumulative_logprob = cumulative
        state.num_summed = len(state.raw_lps)
        return LazySampleLogprobs(  # type: ignore[return-value]
            state.raw_ids[start:],
            state.raw_lps[start:],
            state.raw_ranks[start:],
            self._decoded_token,
        )

    def _build_entries(self, state: RequestState) -> None:
        """Moves the raw logprobs into `logprobs` entries and `cumulative_logprob`."""
        rows = zip(state.raw_ids, state.raw_lps, state.raw_ranks, strict=True)
        state.raw_ids, state.raw_lps, state.raw_ranks = [], [], []
        entries = state.logprobs
        cumulative = state.cumulative_logprob
        decode = self._decoded_token
        for ids, lps, rank in rows:
            entries.append(logprob_entry(ids, lps, rank, decode))
            cumulative += lps[0]
        state.cumulative_logprob = cumulative

    def _prompt_logprobs(self, out: EngineCoreOutput) -> PromptLogprobs:
        """None for the first prompt token (nothing predicts it), then {token id: Logprob} of
        the prompt token and the top-N tokens (ranked 1..N) for each later one."""
        assert out.prompt_logprob_token_ids is not None and out.prompt_logprobs is not None
        entries: PromptLogprobs = [None]
        for ids, lps in zip(out.prompt_logprob_token_ids, out.prompt_logprobs, strict=True):
            top = {
                tid: Logprob(lp, k, self._decoded_token(tid))
                for k, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1)
            }
            entry = {ids[0]: top.get(ids[0]) or Logprob(lps[0], None, self._decoded_token(ids[0]))}
            entries.append(entry | {t: lp for t, lp in top.items() if t != ids[0]})
        return entries

    def _decoded_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded_tokens.get(token_id)
        if text is None:
            text = self._decoded_tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    def _completion(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> CompletionOutput | None:
        """This step's completion per the output kind; None when there is nothing to report."""
        detok = state.detokenizer
        assert detok is not None
        delta = state.output_kind == RequestOutputKind.DELTA
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = detok.get_next_output_text(finished, delta)
        start = state.sent_tokens if delta else 0
        if delta:
            state.sent_tokens = len(detok.token_ids)
        want_logprobs = state.num_logprobs is not None
        logprobs = self._sample_logprobs(state, start) if want_logprobs else None
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=detok.token_ids[start:],
            cumulative_logprob=state.cumulative_logprob if want_logprobs else None,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )

    def _request_output(
        self,
        state: RequestState,
        completion: CompletionOutput | None,
        finished: bool,
        error: str | None,
    ) -> RequestOutput | None:
        parent = state.parent
        if parent is None:
            if completion is None:
                return None
            return self._make_request_output(state, state.request_id, [completion], finished, error)
        if error is not None and parent.error is None:
            parent.error = error
        if completion is not None:
            parent.completions[state.index] = completion
        if finished:
            parent.finished_indices.add(state.index)
        all_finished = parent.finished
        if all_finished:
            self.parent_requests.pop(parent.request_id, None)
        if state.output_kind == RequestOutputKind.DELTA:
            outputs = [completion] if completion is not None else []
        elif state.output_kind == RequestOutputKind.FINAL_ONLY and not all_finished:
            return None
        else:
            outputs = [parent.completions[i] for i in sorted(parent.completions)]
        if not outputs:
            return None
        return self._make_request_output(
            state, parent.request_id, outputs, all_finished, parent.error
        )

    @staticmethod
    def _make_request_output(
        state: RequestState,
        request_id: str,
        outputs: list[CompletionOutput],
        finished: bool,
        error: str | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            encoder_prompt=state.encoder_prompt,
            encoder_prompt_token_ids=state.encoder_prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens,
            error=error,
            extras=state.extras or None,
            prompt_logprobs=state.prompt_logprobs,
            queue_time=state.queue_time,
        )
