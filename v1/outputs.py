"""What the user gets back: generation outputs and pooling (embed / classify / score) outputs.

Names and fields follow vLLM. A request the engine could not serve ends with
`finish_reason == "error"` and its message in `error`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np


class RequestOutputKind(enum.Enum):
    """What each output of a request carries while it runs."""

    CUMULATIVE = 0
    """Everything so far, at every step."""
    DELTA = 1
    """Only what is new since the previous output (streaming)."""
    FINAL_ONLY = 2
    """One output, when the request has finished."""


@dataclass
class Logprob:
    """The log probability of one token and its rank (1 = most likely) among all tokens."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: {token id: Logprob} of the sampled token and the top-N tokens."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: {token id: Logprob} of that token and the top-N tokens; None for the first."""


@dataclass
class CompletionOutput:
    """One completion of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the sampled tokens' logprobs; None unless logprobs were requested."""
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """stop, length, abort or error; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; None for EOS or a length cap."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one generation request so far (or in total, once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    """Decoder prompt tokens served from the prefix cache."""
    error: str | None = None
    """Why the engine failed this request (finish_reason "error"); None otherwise."""
    extras: dict[str, float | list[float]] | None = None
    """Model-specific per-request results (Whisper: no_speech_prob, and token_times for
    `SamplingParams.word_timestamps`)."""
    prompt_logprobs: PromptLogprobs | None = None
    """With SamplingParams.prompt_logprobs, once the first token is out."""
    queue_time: float | None = None
    """Seconds the request waited in the engine before its first step (once known)."""


# ---- pooling ----


@dataclass
class PoolingOutput:
    """The raw pooled output of an encoder-only request (float32)."""

    data: np.ndarray


class EmbeddingOutput:
    """One embedding vector: `data`, the float32 array the engine produced, and `embedding`,
    the same values as a list of floats, made at its first read (4096 MiniLM vectors as float
    lists cost ~40 ms of host time, more than the engine's device work for them on a GPU: a
    caller that reads `data`, or only some vectors, does not pay it)."""

    __slots__ = ("_embedding", "data")

    def __init__(self, embedding: list[float] | np.ndarray) -> None:
        """`embedding`: the vector, as a list of floats or a 1-D array."""
        if isinstance(embedding, np.ndarray):
            self.data = embedding
            self._embedding: list[float] | None = None
        else:
            self._embedding = list(embedding)
            self.data = np.asarray(self._embedding, dtype=np.float32)

    @property
    def embedding(self) -> list[float]:
        """The (float32) embedding vector as Python floats."""
        if self._embedding is None:
            self._embedding = self.data.tolist()
        return self._embedding

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        data = np.asarray(output.data, dtype=np.float32)
        if data.ndim != 1:
            raise ValueError(f"an embedding must be one vector, got shape {data.shape}")
        return EmbeddingOutput(data)

    @property
    def hidden_size(self) -> int:
        return len(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingOutput):
            return NotImplemented
        return self.embedding == other.embedding

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={self.embedding!r})"


@dataclass
class ClassificationOutput:
    probs: list[float]
    """Per class: the probability (or the raw logit when activation is off)."""

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        data = np.asarray(output.data, dtype=np.float32)
        if data.ndim != 1:
            raise ValueError(f"classification output must be one vector, got shape {data.shape}")
        return ClassificationOutput(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        data = np.asarray(output.data, dtype=np.float32).reshape(-1)
        if data.size != 1:
            raise ValueError(f"a score must be a single value, got {data.size}")
        return ScoringOutput(float(data[0]))


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    """The result of one pooling request; `outputs` is a PoolingOutput until converted."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool
    error: str | None = None
    queue_time: float | None = None
    """Seconds the request waited in the engine before its step."""

    @property
    def finish_reason(self) -> str:
        return "error" if self.error is not None else "stop"

    output_type: ClassVar[Any] = None
    """What a subclass's `outputs` are (a class with `from_base(PoolingOutput)`)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[Any]) -> Any:
        """`output` as this subclass: every field kept, `outputs` converted to `output_type`
        (from the instance's dict: `dataclasses.fields` per output cost 1.7 us against 0.85,
        and an embed call converts thousands)."""
        return cls(**{**output.__dict__, "outputs": cls.output_type.from_base(output.outputs)})


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    output_type: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    output_type: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    output_type: ClassVar[Any] = ScoringOutput


@dataclass
class RerankResult:
    """One document of `LLM.rerank`, best first."""

    index: int
    """Position of the document in the input list."""
    document: str
    relevance_score: float
