"""Every message that crosses the frontend <-> EngineCore boundary, as msgspec Structs.

This is the one module that defines the wire format (docs/protocol.md describes it for frontends
in other languages). Fields typed `Any` hold numpy arrays: in-process they are passed as is; over
ZMQ `v1.core.serial` moves them into extra frames without copies. No pickle anywhere.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from v1.lora_request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended. The int values are the wire encoding."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EncoderInput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The first-class encoder input of an encoder-decoder request.

    Exactly one of `token_ids` (BART, T5) and `audio` (Whisper: float32 16 kHz mono samples of
    at most one 30 s window) is set.
    """

    num_encoder_tokens: int
    """Length in encoder positions (what the encoder cache and cross-attention blocks hold)."""
    content_hash: str
    """Hash of the content: equal inputs share one encoder run. Audio may come with "": the
    core computes it (the BLAKE3 hex digest of the samples' bytes, `AudioClip.content_hash`),
    which is how a data-parallel frontend hands hashing to its cores."""
    token_ids: list[int] | None = None
    audio: Any = None


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int] | Any
    """Decoder prompt (decoder-only and encoder-decoder) or the input (encoder-only): a list
    of ints; a packed pooling request (`input_lens`) may send a 1-D integer numpy array, whose
    bytes cross the wire as one frame and which the core checks vectorized (a list of 2,048
    ids costs ~60 ns an id to decode and ~45 ns to check). The core checks the type."""
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    encoder_input: EncoderInput | None = None
    token_type_ids: list[int] | None = None
    input_lens: list[int] | None = None
    """Encoder-only pooling: the request packs several inputs, back to back in
    `prompt_token_ids` (and `token_type_ids`), of these lengths. Each runs apart (attention
    within itself, positions from 0) and is pooled apart; the request's `pooled_output` stacks
    their results, one row each. Only for tasks with one vector per input (embed, classify,
    score). None: the prompt is one input. Packing saves the per-request work of the frontend
    and the core for batches of short inputs."""
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    """Lower runs first under the priority policy."""
    output_token_ids: list[int] | None = None
    """Tokens this sequence already generated (they count as outputs: max_tokens, min_tokens,
    forced tokens, penalties and Whisper rules see them). Beam search continues each beam as a
    new request carrying its tokens so far, forked from its parent's KV (see `fork_from`)."""
    hold_kv: bool = False
    """Keep the request's KV blocks after it finishes (stop or length), for requests that fork
    from it, until it is released: by an ABORT naming it, by its `last_fork` child, or by the
    core under KV pressure (then its forks recompute)."""
    fork_from: str | None = None
    """A finished `hold_kv` request whose tokens (prompt + outputs) begin this one's: the core
    forks its decoder self-attention blocks (full blocks shared, the partial last one copied)
    instead of computing those tokens again. Ignored (the tokens are computed, with prefix
    caching) when that request's KV is gone or its tokens or encoder input differ."""
    last_fork: bool = False
    """No later request forks from `fork_from`: its hold ends once the requests naming it are
    admitted (the last one takes its partial block without a copy)."""
    group_id: str | None = None
    """Requests of one client request (n > 1 samples, a batch of prompts, a transcription's
    windows) share a group; the fcfs waiting queue takes turns between groups, so one client's
    many sequences do not queue ahead of everyone else. None: a group of its own."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model). The core keys the
    request's encoder input and prefix-cache blocks by `lora_int_id`, so no two adapters share
    an encoder output, cross K/V or cached prefix."""
    client_index: int = 0
    """Which of the core's frontends sent it (several API server processes share one core:
    `v1 serve --api-server-count`): its outputs go back on that frontend's output socket."""
    streamed: bool = True
    """The frontend reads this request's tokens step by step (a streamed response). False: only
    its final output is read (offline batches, non-streamed responses, beam steps), so an auto
    num_scheduler_steps may run it in decode bursts; a streamed request runs one token a step
    unless the user set num_scheduler_steps."""


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprob_token_ids: list[list[int]] | None = None
    """Per new token: [sampled id, top-1 id, ..., top-N id]."""
    new_logprobs: list[list[float]] | None = None
    """Per new token: logprobs matching new_logprob_token_ids."""
    new_logprob_ranks: list[int] | None = None
    """Per new token: rank of the sampled token (1 = most likely)."""
    pooled_output: Any = None
    """np.ndarray (float32) for pooling requests."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    extras: dict[str, float | list[float]] | None = None
    """Model-specific per-request results (Whisper: no_speech_prob; token_times, on the final
    output of a word_timestamps request)."""
    prompt_logprob_token_ids: list[list[int]] | None = None
    """With the first new token of a request with prompt_logprobs: per prompt token after the
    first, [that token, top-1 id, ..., top-N id]."""
    prompt_logprobs: list[list[float]] | None = None
    """Logprobs matching prompt_logprob_token_ids."""
    queue_time: float | None = None
    """With a request's first output: seconds from its arrival to its first scheduled step."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_encoder_runs: int = 0
    num_encoder_lookups: int = 0
    """Requests with an encoder input admitted (num_encoder_runs of them ran the encoder)."""
    num_cross_cache_hits: int = 0
    """Of those, admissions that attached to cross-attention K/V already cached (shared by
    encoder content hash): no encoder run and no cross-K/V projection."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_forks: int = 0
    """Requests admitted on a held request's KV (`fork_from`)."""
    num_forked_tokens: int = 0
    """Tokens those forks did not compute again."""
    num_block_copies: int = 0
    """Partial blocks copied for forks (one per diverging sequence and decoder KV group)."""
    num_held_evictions: int = 0
    """Held requests freed for room before their forks came (those forks computed again)."""
    num_decode_bursts: int = 0
    """Engine steps that ran several decode steps back to back (num_scheduler_steps)."""


class UtilityOutput(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: Any = None
    failure_message: str | None = None
    client_index: int = 0
    """The frontend that called (UtilityRequest.client_index)."""


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    engine_dead: bool = False
    """The dead sentinel: the core is exiting after a fatal error (see `error`)."""
    error: str | None = None


class EngineCoreRequestType(enum.Enum):
    """First frame of every frontend -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    ADD_MANY = b"\x04"
    """A list of requests in one message (`EngineCoreClient.batched_adds`), each applied as an
    ADD, in order."""


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    """One of EngineCore.UTILITY_METHODS."""
    args: list[Any] = []
    client_index: int = 0
    """The frontend that asked (see EngineCoreRequest.client_index): the answer goes to it."""


class ReadyMessage(msgspec.Struct, omit_defaults=True):
    """Handshake the core sends once it can take requests."""

    status: str = "READY"
    num_kv_blocks: int = 0
    max_model_len: int = 0
    error: str | None = None


def now() -> float:
    return time.monotonic()
