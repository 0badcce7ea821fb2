"""One window request's engine outputs -> its WindowOutput, for both drivers.

`WindowCollector` takes deltas or one final output (best of n by openai-whisper's ranking);
window beam searches run through `v1.engine.beam_search`; `advance_plan` steps a plan without
letting StopIteration cross a thread pool's future.
"""

from __future__ import annotations

import math
from typing import Any

from v1.engine.beam_search import BeamSearch
from v1.engine.output_processor import LazySampleLogprobs
from v1.engine.transcription.plan_io import Plan, WindowOutput, WindowRequest
from v1.engine.transcription.segments import TranscriptionError, TranscriptionResult
from v1.outputs import RequestOutput

NO_SPEECH_PROB = "no_speech_prob"
TOKEN_TIMES = "token_times"
"""Keys of a Whisper request's `RequestOutput.extras`."""


def advance_plan(
    plan: Plan, output: WindowOutput | None
) -> tuple[WindowRequest | None, TranscriptionResult | None]:
    """(next request, None) or (None, the plan's result): `plan.send` without StopIteration
    (which cannot cross a thread pool's future)."""
    try:
        return plan.send(output), None  # type: ignore[arg-type]
    except StopIteration as stop:
        return None, stop.value


class WindowCollector:
    """The outputs of one window request -> its WindowOutput. Takes deltas (each output
    carries what is new) or one final output alike; of n > 1 samples the best ranked is kept
    (openai-whisper's best_of)."""

    def __init__(self, what: str, length_penalty: float | None = None) -> None:
        """`what` names the request in errors ("audio input 2")."""
        self.what = what
        self.length_penalty = length_penalty
        self.token_ids: dict[int, list[int]] = {}
        """Per sample index."""
        self.logprobs: dict[int, list[float] | None] = {}
        self.extras: dict[str, Any] = {}
        self.finished = False

    def add(self, output: RequestOutput) -> str:
        """Takes one output; returns its new text (empty unless the request detokenizes).
        TranscriptionError when the engine failed the request."""
        if output.error is not None:
            raise TranscriptionError(f"{self.what}: {output.error}")
        text = ""
        for completion in output.outputs:
            k = completion.index
            self.token_ids.setdefault(k, []).extend(completion.token_ids)
            logprobs = self.logprobs.setdefault(k, [])
            if completion.logprobs is None or logprobs is None:
                self.logprobs[k] = None
            elif isinstance(completion.logprobs, LazySampleLogprobs):
                values = completion.logprobs.sampled_logprobs()
                assert len(values) == len(completion.token_ids)
                logprobs += values
            else:
                logprobs += [
                    entry[token].logprob
                    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
                ]
            text += completion.text
        self.extras.update(output.extras or {})
        self.finished = self.finished or output.finished
        return text

    def result(self) -> WindowOutput:
        if not self.finished:
            raise TranscriptionError(f"{self.what}: the request ended without an output")
        best = max(
            sorted(self.token_ids), key=lambda k: _rank(self.logprobs[k], self.length_penalty)
        )
        token_times = self.extras.get(TOKEN_TIMES) if len(self.token_ids) == 1 else None
        return WindowOutput(
            self.token_ids[best],
            self.logprobs[best],
            self.extras.get(NO_SPEECH_PROB),
            list(token_times) if token_times is not None else None,
        )


def _rank(logprobs: list[float] | None, length_penalty: float | None) -> float:
    """openai-whisper's MaximumLikelihoodRanker score of one sample."""
    if not logprobs:
        return float("-inf")
    length = len(logprobs)
    penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
    return math.fsum(logprobs) / penalty


def window_beam_search(request: WindowRequest) -> BeamSearch:
    """The beam search of a window request with `beam` (its one core request is the base)."""
    (base,) = request.core_requests
    assert request.beam is not None and base.sampling_params is not None
    eos_ids = [] if base.eos_token_id is None else [base.eos_token_id]
    eos_ids += [t for t in base.sampling_params.stop_token_ids or [] if t not in eos_ids]
    return BeamSearch(base, request.beam, eos_ids)


def beam_window_output(search: BeamSearch) -> WindowOutput:
    """The best beam of a finished window beam search."""
    best = search.result()[0]
    return WindowOutput(best.token_ids, best.logprobs, search.first_extras.get(NO_SPEECH_PROB))
