"""Beam search over the engine, scored and finished exactly as transformers' `generate(num_beams)`.

The frontend ranks (`BeamSearch`, pure Python); the engine keeps the KV: each step request is
sent with `hold_kv` and each next beam forks its parent with `fork_from`, so a beam computes one
token a step. The drivers (`run_beam_search[_async]`) release every held step when a search ends.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from v1.audio.clip import audio_content_hash
from v1.core.protocol import EncoderInput, EngineCoreOutput, EngineCoreRequest, FinishReason
from v1.sampling_params import SamplingParams

_NEG = -1.0e9
"""transformers' "impossible" score (running beams 1.. at the start, finished masks)."""
MAX_BEAM_WIDTH = 10
"""2 * beam_width logprobs per step must fit SamplingParams.logprobs (at most 20)."""


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Beam search settings (transformers' `generate(num_beams=...)` names in brackets)."""

    beam_width: int
    """Beams kept per step [num_beams], 1..10."""
    max_tokens: int
    """Generated tokens at most [max_new_tokens]."""
    length_penalty: float = 1.0
    """A finished beam scores sum(logprobs) / num_generated_tokens ** length_penalty."""
    early_stopping: bool | str = False
    """True: stop once beam_width beams finished; False: stop when no running beam can still
    beat the worst finished one at its current length; "never": only when none can at any
    length up to max_tokens (the canonical beam search with length_penalty 0)."""
    num_return_sequences: int | None = None
    """Best finished beams returned (None: all beam_width)."""
    patience: float | None = None
    """openai-whisper's patience: keep round(beam_width * patience) finished beams and stop once
    that many finished (None: transformers' rule above)."""
    ignore_eos: bool = False
    """Never finish on EOS (beams run to max_tokens)."""

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(
            self.length_penalty, (int, float)
        ):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'early_stopping must be True, False or "never", got {self.early_stopping!r}'
            )
        n = self.num_return_sequences
        if n is not None and (not is_int(n) or not 1 <= n <= self.beam_width):
            raise ValueError(f"num_return_sequences must be in [1, beam_width], got {n!r}")
        if self.patience is not None and (
            isinstance(self.patience, bool)
            or not isinstance(self.patience, (int, float))
            or not 0 < self.patience <= 100
        ):
            raise ValueError(f"patience must be a number in (0, 100], got {self.patience!r}")

    @property
    def num_finished_kept(self) -> int:
        if self.patience is None:
            return self.beam_width
        return max(self.beam_width, round(self.beam_width * self.patience))


@dataclass
class BeamSearchSequence:
    """One finished beam: its generated tokens (EOS included when it ended on one)."""

    token_ids: list[int]
    logprobs: list[float]
    """Processed logprob of each token (what the score sums)."""
    score: float
    """sum(logprobs) / len(token_ids) ** length_penalty: transformers' `sequences_scores`."""
    cumulative_logprob: float
    finish_reason: str
    """"stop" (EOS) or "length" (max_tokens)."""
    text: str = ""


@dataclass
class BeamSearchOutput:
    """The finished beams of one prompt, best first."""

    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: tuple[int, ...]
    score: float
    """Running sum of logprobs (float32 arithmetic, as transformers)."""
    logprobs: tuple[float, ...] = ()


def _f32(x: float) -> float:
    """Rounds to float32 (transformers keeps its beam scores in float32)."""
    return float(np.float32(x))


class BeamSearch:
    """One prompt's beam search: `requests()` says which sequences need a step, `advance()`
    takes their top logprobs and moves the search one token (transformers' `_beam_search`)."""

    def __init__(
        self,
        base: EngineCoreRequest,
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        assert base.sampling_params is not None
        self.base = base
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.num_beams = params.beam_width
        self.beams_to_keep = max(2, 1 + len(self.eos_token_ids)) * self.num_beams
        self.forced_eos = base.sampling_params.forced_eos_token_id
        self.step_params = base.sampling_params.clone(
            n=1,
            temperature=0.0,
            logprobs=self.beams_to_keep,
            logprobs_mode="processed",
            forced_eos_token_id=None,  # forced here, on the last step (see _candidates)
            detokenize=False,
            stop=None,  # stop strings need text: not applied to beams
        )
        # Beams 1.. start at -1e9 (transformers): they are copies of beam 0 that only matter
        # when beam 0 has fewer finite continuations than beams_to_keep.
        self.running = [_Beam((), 0.0)] + [_Beam((), _NEG) for _ in range(self.num_beams - 1)]
        self.num_kept = params.num_finished_kept
        self.finished: list[tuple[float, tuple[int, ...], float, tuple[float, ...]]] = []
        """(length-normalized score, tokens, cumulative logprob, logprobs), best first."""
        self.first_extras: dict[str, float] = {}
        """Model-specific results of the first step (Whisper: no_speech_prob)."""
        self.improvement_possible = True
        self.done = False
        self.cur_len = 0
        """Tokens generated by every running beam."""
        self.num_steps = 0
        self.step_ids: dict[tuple[int, ...], str] = {}
        """Sequence -> id of the request that ran it in the last step sent: in flight, then
        held by the core (its KV kept for the next step's forks) until released."""
        self.parent_ids: list[str] = []
        """The step before's requests, until the last step's outputs are in (by then each was
        released by its last fork or an abort; a search given up earlier aborts them)."""

    # ---- engine requests ----
    def pending_sequences(self) -> list[tuple[int, ...]]:
        """Distinct sequences of live beams that need the engine's logprobs this step."""
        if self.done or self._forced_eos_now():
            return []
        return list(dict.fromkeys(b.tokens for b in self.running if b.score > _NEG / 2))

    def make_request(
        self, tokens: tuple[int, ...], request_id: str, parent_id: str | None = None
    ) -> EngineCoreRequest:
        """The step request of one sequence; `parent_id`: the held request of tokens[:-1]."""
        # min_tokens keeps its meaning (EOS masked while fewer outputs) within this step's cap.
        params = self.step_params.clone(
            max_tokens=len(tokens) + 1,
            min_tokens=min(self.step_params.min_tokens, len(tokens) + 1),
        )
        changes: dict[str, Any] = {}
        enc = self.base.encoder_input
        if enc is not None and self.num_steps > 0:
            # The first step sent the data; later ones name it (the core keeps it by hash;
            # audio the first step sent unhashed is hashed here, as the core did).
            if not enc.content_hash:
                enc = msgspec.structs.replace(enc, content_hash=audio_content_hash(enc.audio))
                self.base = msgspec.structs.replace(self.base, encoder_input=enc)
            changes["encoder_input"] = EncoderInput(
                num_encoder_tokens=enc.num_encoder_tokens, content_hash=enc.content_hash
            )
        return msgspec.structs.replace(
            self.base,
            request_id=request_id,
            sampling_params=params,
            output_token_ids=list(tokens) or None,
            group_id=self.base.group_id or self.base.request_id,
            hold_kv=True,
            fork_from=parent_id,
            **changes,
        )

    def _forced_eos_now(self) -> bool:
        return self.forced_eos is not None and self.cur_len == self.params.max_tokens - 1

    # ---- one step ----
    def advance(self, logprobs: dict[tuple[int, ...], list[tuple[int, float]]]) -> None:
        """Moves every beam one token. `logprobs[tokens]`: the top (token id, processed
        logprob) pairs of each sequence `pending_sequences()` returned."""
        assert not self.done
        candidates = self._candidates(logprobs)
        top = candidates[: self.beams_to_keep]
        new_len = self.cur_len + 1
        hits = [
            tokens[-1] in self.eos_token_ids or new_len >= self.params.max_tokens
            for _, tokens, _ in top
        ]
        # Running beams: the best num_beams continuations that did not just finish (finished
        # ones sink by 1e9, as in transformers, so they refill only when too few are left).
        running = sorted(
            (
                (score + (_NEG if hit else 0.0), i)
                for i, ((score, _, _), hit) in enumerate(zip(top, hits, strict=True))
            ),
            key=lambda x: -x[0],
        )[: self.num_beams]
        # Finished beams: the top num_beams candidates that hit EOS / max length may enter.
        full = len(self.finished) >= self.num_kept
        can_add = self.improvement_possible and not (full and self.params.early_stopping is True)
        if can_add:
            denom = _f32(float(new_len) ** self.params.length_penalty)
            new = [
                (_f32(score / denom), tokens, score, lps)
                for i, ((score, tokens, lps), hit) in enumerate(zip(top, hits, strict=True))
                if hit and i < self.num_beams
            ]
            merged = self.finished + new
            merged.sort(key=lambda x: -x[0])  # stable: earlier entries win ties
            self.finished = merged[: self.num_kept]
        self.running = [_Beam(top[i][1], _f32(s), top[i][2]) for s, i in running]
        self.cur_len = new_len
        self.num_steps += 1
        self._update_stop(all(hits))

    def _candidates(
        self, logprobs: dict[tuple[int, ...], list[tuple[int, float]]]
    ) -> list[tuple[float, tuple[int, ...], tuple[float, ...]]]:
        """All continuations (accumulated score, tokens), best first; ties keep beam order,
        then the engine's top-k order (torch.topk over the flattened beams x vocab)."""
        out: list[tuple[float, int, int, tuple[int, ...]]] = []
        forced = self._forced_eos_now()
        for b, beam in enumerate(self.running):
            if beam.score <= _NEG / 2:
                continue  # a placeholder copy: its continuations never rank (see __init__)
            pairs = [(self.forced_eos, 0.0)] if forced else logprobs[beam.tokens]
            for rank, (token, lp) in enumerate(pairs):
                if lp == -math.inf:
                    continue
                lps = (*beam.logprobs, lp)
                out.append((_f32(beam.score + lp), b, rank, (*beam.tokens, token), lps))
        out.sort(key=lambda x: (-x[0], x[1], x[2]))
        return [(score, tokens, lps) for score, _, _, tokens, lps in out]

    def _update_stop(self, all_hit: bool) -> None:
        """transformers' `_check_early_stop_heuristic` and `_beam_search_has_unfinished_sequences`
        after cur_len advanced."""
        p = self.params
        full = len(self.finished) >= self.num_kept
        if self.running:
            if p.early_stopping == "never" and p.length_penalty > 0.0:
                best_length = p.max_tokens
            else:
                best_length = self.cur_len
            denom = _f32(float(best_length) ** p.length_penalty)
            best_running = _f32(self.running[0].score / denom)
            worst_finished = self.finished[-1][0] if full else _NEG
            self.improvement_possible = self.improvement_possible and best_running > worst_finished
        else:
            self.improvement_possible = False  # nothing left running
        early_true = p.early_stopping is True or p.patience is not None
        open_beam = not (full and early_true)
        self.done = not (self.improvement_possible and open_beam and not all_hit)

    # ---- results ----
    def result(self) -> list[BeamSearchSequence]:
        n = self.params.num_return_sequences or self.num_beams
        out = []
        for score, tokens, cumulative, logprobs in self.finished[:n]:
            ends_on_eos = bool(tokens) and tokens[-1] in self.eos_token_ids
            out.append(
                BeamSearchSequence(
                    token_ids=list(tokens),
                    logprobs=list(logprobs),
                    score=score,
                    cumulative_logprob=cumulative,
                    finish_reason="stop" if ends_on_eos else "length",
                )
            )
        return out


def _top_logprobs(output: EngineCoreOutput) -> list[tuple[int, float]]:
    """The step's top-N (token, logprob) pairs (the sampled token's entry dropped)."""
    if output.error is not None or output.finish_reason == FinishReason.ERROR:
        raise RuntimeError(f"beam search step failed: {output.error}")
    if not output.new_logprob_token_ids or output.new_logprobs is None:
        raise RuntimeError(f"beam search step {output.request_id} returned no logprobs")
    ids, lps = output.new_logprob_token_ids[0], output.new_logprobs[0]
    return list(zip(ids[1:], lps[1:], strict=True))


RunRequests = Callable[[list[EngineCoreRequest], list[str]], dict[str, EngineCoreOutput]]
"""Queues the requests, then releases the held requests of the ids (an abort), and returns each
request's final output."""
RunRequestsAsync = Callable[
    [list[EngineCoreRequest], list[str]], Awaitable[dict[str, EngineCoreOutput]]
]
Release = Callable[[list[str]], None]
"""Aborts requests (in flight) or releases them (held), without waiting."""

StepKeys = list[tuple[int, tuple[int, ...], str]]
"""(search index, sequence, request id) of each request of a step."""


@dataclass
class BeamStep:
    """One round of engine work for many searches."""

    requests: list[EngineCoreRequest]
    keys: StepKeys
    release_ids: list[str]
    """Held requests of the step before that no request of this step forks from: release
    them after queueing `requests`."""


def beam_step_requests(searches: list[BeamSearch]) -> BeamStep:
    """The next step's requests of every search, each forking from its parent's held request
    (the last child of a parent releases it); a search that is done releases its last step."""
    step = BeamStep([], [], [])
    for i, search in enumerate(searches):
        parents = search.step_ids
        last_child: dict[str, EngineCoreRequest] = {}
        step_ids = {}
        for j, tokens in enumerate(search.pending_sequences()):
            req_id = f"{search.base.request_id}-beam{search.num_steps}.{j}"
            parent_id = parents.get(tokens[:-1]) if tokens else None
            request = search.make_request(tokens, req_id, parent_id)
            if parent_id is not None:
                last_child[parent_id] = request
            step.requests.append(request)
            step.keys.append((i, tokens, req_id))
            step_ids[tokens] = req_id
        for request in last_child.values():
            request.last_fork = True
        step.release_ids.extend(r for r in parents.values() if r not in last_child)
        search.parent_ids = [*search.parent_ids, *parents.values()]
        search.step_ids = step_ids
    return step


def take_step_request_ids(searches: list[BeamSearch]) -> list[str]:
    """The requests of every search that may still be in flight or held in the core (its last
    step, and the one before while the last step's outputs are not in), forgotten: abort them
    when the searches end or fail."""
    ids = [r for s in searches for r in (*s.parent_ids, *s.step_ids.values())]
    for search in searches:
        search.step_ids, search.parent_ids = {}, []
    return ids


def advance_beam_searches(
    searches: list[BeamSearch], keys: StepKeys, outputs: dict[str, EngineCoreOutput]
) -> None:
    """Moves every search one token with its step's outputs (the step before is released by
    now: its forks were admitted or it was aborted)."""
    per_search: list[dict[tuple[int, ...], list[tuple[int, float]]]] = [{} for _ in searches]
    for i, tokens, req_id in keys:
        output = outputs[req_id]
        per_search[i][tokens] = _top_logprobs(output)
        if searches[i].num_steps == 0 and output.extras:
            searches[i].first_extras.update(output.extras)
    for search, logprobs in zip(searches, per_search, strict=True):
        search.parent_ids = []
        if not search.done:
            search.advance(logprobs)


def run_beam_search(searches: list[BeamSearch], run: RunRequests, release: Release) -> None:
    """Steps every search to the end; `run` executes one round of core requests, `release`
    frees what the last round left held (also when a step fails)."""
    try:
        while not all(s.done for s in searches):
            step = beam_step_requests(searches)
            outputs: dict[str, EngineCoreOutput] = {}
            if step.requests:
                outputs = run(step.requests, step.release_ids)
            elif step.release_ids:
                release(step.release_ids)
            advance_beam_searches(searches, step.keys, outputs)
    finally:
        held = take_step_request_ids(searches)
        if held:
            release(held)


async def run_beam_search_async(
    searches: list[BeamSearch], run: RunRequestsAsync, release: Release
) -> None:
    try:
        while not all(s.done for s in searches):
            step = beam_step_requests(searches)
            outputs: dict[str, EngineCoreOutput] = {}
            if step.requests:
                outputs = await run(step.requests, step.release_ids)
            elif step.release_ids:
                release(step.release_ids)
            advance_beam_searches(searches, step.keys, outputs)
    finally:
        held = take_step_request_ids(searches)
        if held:
            release(held)


def make_beam_search(
    engine: Any,
    request_id: str,
    prompt: Any,
    params: BeamSearchParams,
    sampling_params: SamplingParams | None = None,
    lora_request: Any = None,
) -> BeamSearch:
    """Validates and processes `prompt` once (tokens, audio decoding and hashing) with greedy
    `sampling_params` (the generation-config rules filled in) and sets up its search; raises
    ValueError on invalid input. `engine`: an LLMEngine or AsyncLLM (its input processor).
    `lora_request`: the LoRA adapter every beam runs with (each step's requests copy the
    base request, adapter included)."""
    if sampling_params is not None and sampling_params.structured_outputs is not None:
        raise ValueError(
            "beam search does not support structured_outputs (a grammar constrains one "
            "sequence; use generate)"
        )
    base_params = (sampling_params or SamplingParams()).clone(
        n=1, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos
    )
    base = engine.input_processor.process(request_id, prompt, base_params)
    if lora_request is not None:
        engine.input_processor.check_lora(lora_request)
        base = msgspec.structs.replace(base, lora_request=lora_request)
    max_model_len = engine.model_config.effective_max_model_len
    room = max_model_len - len(base.prompt_token_ids)
    if params.max_tokens > room:
        params = msgspec.structs.replace(params, max_tokens=room)
    eos_ids = [] if base.eos_token_id is None else [base.eos_token_id]
    assert base.sampling_params is not None
    eos_ids += [t for t in base.sampling_params.stop_token_ids or [] if t not in eos_ids]
    return BeamSearch(base, params, eos_ids)


def beam_search_output(search: BeamSearch, tokenizer: Any) -> BeamSearchOutput:
    """The search's finished beams, best first, with their text."""
    sequences = search.result()
    for seq in sequences:
        seq.text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    return BeamSearchOutput(search.base.request_id, list(search.base.prompt_token_ids), sequences)
