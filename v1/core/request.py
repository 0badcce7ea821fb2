"""`Request`, the EngineCore's view of one request: tokens, progress and status. Each rule on
them is stated once here (`num_schedulable_tokens`) or in the scheduler part that applies it.
"""

from __future__ import annotations

import enum

import msgspec

from v1.core.protocol import EncoderInput, EngineCoreRequest, FinishReason
from v1.lora_request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    # Slots: one is built per request at admission (4096 for a batch of embeddings).
    __slots__ = (
        "request_id",
        "lora_request",
        "prompt_token_ids",
        "sampling_params",
        "pooling_params",
        "encoder_input",
        "token_type_ids",
        "input_lens",
        "eos_token_id",
        "arrival_time",
        "priority",
        "max_model_len",
        "group_id",
        "num_times_passed",
        "status",
        "stop_reason",
        "error",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "admitted_step",
        "num_output_placeholders",
        "output_token_ids",
        "all_token_ids",
        "block_hashes",
        "num_kv_slots",
        "hold_kv",
        "fork_from",
        "last_fork",
        "streamed",
        "max_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
        *,
        encoder_input: EncoderInput | None = None,
        token_type_ids: list[int] | None = None,
        input_lens: list[int] | None = None,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        max_model_len: int = 1 << 30,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError("a request needs exactly one of sampling_params and pooling_params")
        self.request_id = request_id
        self.lora_request = lora_request
        if lora_request is not None and encoder_input is not None:
            # Keyed by adapter: the encoder runs with it, so its output, the cross K/V and
            # every cache keyed by the content hash differ per adapter.
            encoder_input = msgspec.structs.replace(
                encoder_input,
                content_hash=f"{encoder_input.content_hash}|lora:{lora_request.lora_int_id}",
            )
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.encoder_input = encoder_input
        self.token_type_ids = token_type_ids
        self.input_lens = input_lens
        """The packed inputs' lengths (EngineCoreRequest.input_lens); None: one input."""
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.max_model_len = max_model_len
        self.group_id = group_id if group_id is not None else request_id
        """Fair-share group in the waiting queue (see EngineCoreRequest.group_id)."""
        self.num_times_passed = 0
        """Steps in which a later waiting request was admitted while this one could not run."""

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.admitted_step = 0
        """The scheduler step that last admitted it: a step launched before a preemption and
        read back after the re-admission holds stale rows of it (depth > 2 pipelining)."""
        self.num_output_placeholders = 0
        """Tokens being sampled by launched steps whose results are not read back yet
        (pipelined scheduling): the next step already feeds them to the model on the device."""
        self.output_token_ids: list[int] = []
        # A pooling request never grows: its token list is the prompt itself, not a copy.
        self.all_token_ids: list[int] = (
            prompt_token_ids if pooling_params is not None else list(prompt_token_ids)
        )
        self.block_hashes: list[bytes] = []
        """Chained hashes of the full blocks of all_token_ids (filled by the KV cache manager)."""
        self.num_kv_slots = 0
        """Decoder tokens its KV block tables hold slots for (kept by the KV cache manager): never
        more than they hold, so a step whose tokens fit needs no allocation; 0 when unknown."""
        self.hold_kv = False
        """Keep the KV blocks after finishing, for forks (EngineCoreRequest.hold_kv)."""
        self.fork_from: str | None = None
        """The held request whose KV this one forks at admission (EngineCoreRequest.fork_from);
        cleared once admitted."""
        self.last_fork = False
        self.streamed = True
        """Its tokens are read step by step (EngineCoreRequest.streamed)."""

        if sampling_params is not None:
            room = max_model_len - len(prompt_token_ids)
            self.max_tokens = min(sampling_params.max_tokens or room, room)
        else:
            self.max_tokens = 0

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        # A pooling request's prompt list is kept as sent (nothing changes it; two copies of
        # its ~hundreds of ids were most of building one); a generating request's is copied.
        prompt = req.prompt_token_ids
        request = cls(
            req.request_id,
            prompt if req.pooling_params is not None else list(prompt),
            req.sampling_params,
            req.pooling_params,
            encoder_input=req.encoder_input,
            token_type_ids=req.token_type_ids,
            input_lens=req.input_lens,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            max_model_len=max_model_len,
            group_id=req.group_id,
            lora_request=req.lora_request,
        )
        if req.output_token_ids:
            # A continued sequence: it runs like a request resumed after preemption.
            request.append_output_token_ids(list(req.output_token_ids))
        request.hold_kv = req.hold_kv
        request.streamed = req.streamed
        request.fork_from = req.fork_from
        request.last_fork = req.last_fork
        return request

    # ---- derived ----
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens a step may feed now: known or in-flight ones not computed yet; 0 while
        tokens are in flight and they already reach the output or length limit (the request
        finishes when they are read back), or the request has a grammar (its next mask depends
        on its last token: pipelined scheduling skips it for one step instead)."""
        placeholders = self.num_output_placeholders
        num_tokens = len(self.all_token_ids) + placeholders
        if placeholders and (
            len(self.output_token_ids) + placeholders >= self.max_tokens
            or num_tokens >= self.max_model_len
            or (
                self.sampling_params is not None
                and self.sampling_params.structured_outputs is not None
            )
        ):
            return 0
        return num_tokens - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        return self.encoder_input.num_encoder_tokens if self.encoder_input is not None else 0

    @property
    def encoder_hash(self) -> str | None:
        return self.encoder_input.content_hash if self.encoder_input is not None else None

    @property
    def num_inputs(self) -> int:
        """Inputs the request runs apart: its packed inputs, else 1."""
        return 1 if self.input_lens is None else len(self.input_lens)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def lora_int_id(self) -> int:
        """The request's adapter (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        assert self.pooling_params is None, "a pooling request's tokens are its prompt list"
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower priority value, then earlier arrival, then id."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
