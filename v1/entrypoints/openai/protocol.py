"""Pydantic request and response bodies of the OpenAI-compatible server.

Requests follow OpenAI's field names (plus vLLM's sampling extensions); validation happens here,
so a bad field is a 400 naming that field. No field is silently ignored: an unknown one is a 400
"Unrecognized request argument supplied: X" (OpenAI's rule, `extra="forbid"`), and every field of
OpenAI's own spec is declared, then honoured or refused with a 400 saying it is not supported
(serving_*.py). NaN and infinity are rejected.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    StringConstraints,
    field_validator,
)

from v1.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

MAX_N = 128
"""Most completions per prompt (SamplingParams' limit)."""
MAX_BATCH_INPUTS = 2048
"""Most prompts / inputs / documents in one request (OpenAI's embeddings limit)."""
INT32_MAX = 2**31 - 1
"""Largest count or token id accepted (what the engine's int32 tensors hold)."""
FLOAT32_MAX = 3.4028234663852886e38
"""Largest float accepted (what the engine's float32 tensors hold)."""
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
MAX_LENGTH_PENALTY = 10.0
"""Beam search's length_penalty is in [-10, 10] (length ** penalty stays a finite, non-zero
float for every length the engine holds)."""
StopString = Annotated[StrictStr, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        """JSON may escape half a UTF-16 pair (\\ud800); no tokenizer or response can hold it.
        (Nested models check their own fields.)"""
        if _has_surrogate(value):
            raise ValueError(
                "holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode text"
            )
        return value


def _has_surrogate(value: Any) -> bool:
    """A str with a lone surrogate in `value` (nested models check themselves)."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


# ---- models ----


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "v1-engine"
    root: str | None = None
    parent: str | None = None
    """The base model of a LoRA adapter (None for the base model itself)."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Only false (or null) is supported: chunks carry no obfuscation padding."""


# ---- sampling fields shared by completions and chat ----

PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class SamplingFields(OpenAIModel):
    """OpenAI sampling fields and vLLM's extensions (None: the engine's default)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """token id (as a string) -> bias in [-100, 100]."""
    response_format: dict[str, Any] | None = None
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}."""
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=FLOAT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_BATCH_INPUTS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    # vLLM extensions: structured outputs (at most one of these and response_format)
    guided_json: StrictStr | dict[str, Any] | None = None
    """A JSON schema (object or its JSON text) the output validates against."""
    guided_regex: StrictStr | None = None
    """A regular expression the whole output matches."""
    guided_choice: list[StrictStr] | None = Field(None, min_length=1, max_length=MAX_BATCH_INPUTS)
    """The output is exactly one of these strings."""
    guided_grammar: StrictStr | None = None
    """A context-free grammar (Lark `start: ...` or GBNF/EBNF `root ::= ...`)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's form: exactly one of {"json", "regex", "choice", "grammar", "json_object"}."""
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """The prompt's logprobs with the top-N tokens per position (`prompt_logprobs` in the
    answer; the first prompt token has none)."""
    priority: int = Field(0, ge=-INT32_MAX - 1, le=INT32_MAX)
    """Scheduling priority under --scheduling-policy priority (lower runs first)."""

    @field_validator("response_format", mode="after")
    @classmethod
    def _no_false_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The JSON schema `false` matches no value: nothing could be generated (it is not
        "any JSON", which is `true` or `{}`)."""
        if value is not None and value.get("type") == "json_schema":
            spec = value.get("json_schema")
            if isinstance(spec, dict) and spec.get("schema") is False:
                raise ValueError(
                    "json_schema.schema is `false`, a schema no JSON value matches; use `true` "
                    "or {} for any JSON"
                )
        return value


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    # vLLM extensions: beam search (best_of beams, default n; the n best are returned)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] = False


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # OpenAI message fields of function calling and audio: refused unless null (no tools).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_BATCH_INPUTS)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI options the server does not implement: accepted here only to answer 400 naming
    # them (serving_completions), never to be silently ignored.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    """Only false (or null): this server stores no completions."""
    metadata: dict[str, str] | None = None
    """Only with store (unsupported): must be null or empty."""
    service_tier: str | None = None
    """"auto" or "default" (the one tier this server has); others are refused."""
    prompt_cache_retention: str | None = None
    """"in_memory" (the automatic prefix cache); "24h" is refused."""
    prompt_cache_options: dict[str, Any] | None = None
    """Refused unless null or empty (prefix caching here is automatic, without options)."""
    # Identifiers with no effect on the answer: the server keeps no per-user state and its
    # prefix cache is automatic, so there is nothing for them to change.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


# ---- completion responses ----


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a prompt position (vLLM's shape): logprob, rank (1 = most likely; null for
    the prompt's own token outside the top-N) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsOut = list[dict[str, PromptLogprob] | None]
"""Per prompt token: {token id (as a string): PromptLogprob} of that token and the top-N; null
for the first token."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionStreamResponse(CompletionResponse):
    """A streamed completion chunk: OpenAI's chunks are `text_completion` objects with the
    same fields as the whole answer."""


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


# ---- tokenize, detokenize ----


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_BATCH_INPUTS)
    add_special_tokens: bool = True
    """For a prompt: add the tokenizer's special tokens (BOS...)."""
    add_generation_prompt: bool = True
    """For messages: end with the assistant turn's header, as chat completions do."""
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- embeddings, score, rerank ----


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


class RerankDocument(OpenAIModel):
    text: StrictStr


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument] = Field(max_length=MAX_BATCH_INPUTS)
    top_n: int | None = Field(None, ge=1, le=INT32_MAX)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


# ---- audio ----

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class TranscriptionUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int


class TranscriptionResponse(BaseModel):
    text: str
    usage: TranscriptionUsage | None = None


class TranscriptionSegmentOut(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float
    no_speech_prob: float | None


class TranscriptionWordOut(BaseModel):
    word: str
    start: float
    end: float
    probability: float | None = None
    """Mean probability of the word's tokens (faster-whisper's word probability)."""


class TranscriptionVerboseResponse(BaseModel):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegmentOut] | None = None
    words: list[TranscriptionWordOut] | None = None
    usage: TranscriptionUsage | None = None
