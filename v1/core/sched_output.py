"""SchedulerOutput: the only contract between the scheduler and the worker.

New (and resumed) requests carry their full data once; running requests carry deltas only.
The runner keeps everything else (its own sampled tokens included) in its persistent batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from v1.core.protocol import EncoderInput
from v1.lora_request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption (empty for a new request)."""
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    block_ids: tuple[list[int], ...]
    """One list per KV cache group, in KVCacheConfig.groups order."""
    num_computed_tokens: int
    encoder_input: EncoderInput | None = None
    token_type_ids: list[int] | None = None
    input_lens: list[int] | None = None
    """Packed encoder-only inputs (EngineCoreRequest.input_lens); None: one input."""
    eos_token_id: int | None = None
    """The request's EOS (min_tokens holds it back)."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> decoder (or encoder-only input) tokens this step."""
    total_num_scheduled_tokens: int
    encoder_reqs: list[str] = field(default_factory=list)
    """Encoder-decoder requests on their first step since admission or resume whose cross
    blocks are new: their encoder output (looked up by content hash) is projected into them now.
    Requests that attached to cross blocks another reader filled (same content hash) are not
    listed: they only read."""
    encoder_hashes_to_run: dict[str, str] = field(default_factory=dict)
    """content hash -> req_id whose input to encode: hashes the encoder cache does not hold."""
    free_encoder_hashes: list[str] = field(default_factory=list)
    """Encoder outputs the runner may drop (evicted from the encoder cache)."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV block ids: the runner copies each whole block (every KV cache tensor that
    holds decoder self-attention) before the step's forward, reading every src before writing
    any dst. Forks of a held request's partial last block (copy-on-write)."""
    step_id: int = 0
    """The scheduler's count of steps, this one included."""
    num_decode_steps: int = 1
    """Decode steps the runner runs back to back (SchedulerConfig.num_scheduler_steps): the
    first feeds each request's one scheduled token, each later one the token the previous one
    sampled; every request samples this many tokens (KV slots are allocated for them)."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the last step (including preempted ones, which come
    back later as new requests)."""
    structured_output_req_ids: list[str] = field(default_factory=list)
    """Requests of this step whose next token is constrained by a grammar (structured outputs)."""
    grammar_bitmask: Any = None
    """np.ndarray [len(structured_output_req_ids), ceil(vocab / 32)] int32: row i allows token t
    when bit t % 32 of word t // 32 is set (filled by the EngineCore after scheduling)."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    """Requests of this step, in batch order."""
    sampled_token_ids: list[list[int]]
    """Per request: the new token(s), or [] when the step did not reach the end of its prompt."""
    logprob_token_ids: list[list[list[int]] | None] | None = None
    logprobs: list[list[list[float]] | None] | None = None
    logprob_ranks: list[list[int] | None] | None = None
    pooler_output: list[Any] | None = None
    """Per request: np.ndarray (float32) for pooling requests, else None."""
    num_encoder_runs: int = 0
    """Encoder inputs run this step (for stats and tests)."""
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    """req_id -> model-specific per-request results (e.g. Whisper no_speech_prob)."""
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]]]] = field(
        default_factory=dict
    )
    """req_id -> (index of the first prompt token covered, per token [token, top ids...], their
    logprobs): the prompt logprobs this step's chunk of the prompt yields."""
    failed: dict[str, str] = field(default_factory=dict)
    """req_id -> error: requests the runner failed alone (a LoRA adapter it could not read);
    their rows ran and are dropped, the scheduler ends them with finish reason error."""


class DeferredRunnerOutput(Protocol):
    """A launched step whose results are not read back yet (pipelined scheduling)."""

    def get_output(self) -> ModelRunnerOutput:
        """Waits for the step and returns its output (raises what the step raised)."""
        ...


@dataclass
class ReadyRunnerOutput:
    """A DeferredRunnerOutput of a step that already finished (synchronous executors)."""

    output: ModelRunnerOutput

    def get_output(self) -> ModelRunnerOutput:
        return self.output


@dataclass
class BurstRunnerOutput:
    """A DeferredRunnerOutput of a decode burst (SchedulerOutput.num_decode_steps > 1): the
    outputs of its steps, read back in order and joined per request."""

    steps: list[DeferredRunnerOutput]

    def get_output(self) -> ModelRunnerOutput:
        outputs = [step.get_output() for step in self.steps]
        first = outputs[0]
        for out in outputs[1:]:
            assert out.req_ids == first.req_ids, "a burst's steps run the same requests"
        first.sampled_token_ids = [
            [t for tokens in rows for t in tokens]
            for rows in zip(*(o.sampled_token_ids for o in outputs), strict=True)
        ]
        if any(o.logprobs is not None for o in outputs):
            for name in ("logprob_token_ids", "logprobs", "logprob_ranks"):
                setattr(first, name, _join_rows([getattr(o, name) for o in outputs]))
        for out in outputs[1:]:
            for req_id, extras in out.extras.items():
                first.extras.setdefault(req_id, {}).update(extras)
        return first


def _join_rows(per_step: list[Any]) -> list[Any]:
    """Per request, its rows of every step in order (None where no step has any)."""
    width = max(len(rows) for rows in per_step if rows is not None)
    per_step = [rows if rows is not None else [None] * width for rows in per_step]
    joined = []
    for rows in zip(*per_step, strict=True):
        present = [r for r in rows if r is not None]
        joined.append([x for r in present for x in r] if present else None)
    return joined
