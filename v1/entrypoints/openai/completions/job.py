"""One validated completions or chat request (`_Job`), its prompts and its accounting (usage,
finish reasons for the metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from v1.entrypoints.openai.errors import APIError
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.entrypoints.openai.protocol import UsageInfo
from v1.entrypoints.openai.serving_engine import lora_unreadable_error
from v1.outputs import CompletionOutput, RequestOutput
from v1.sampling_params import SamplingParams


@dataclass
class _Prompt:
    engine_prompt: Any
    num_decoder_tokens: int
    """Decoder-prompt tokens, counted against max_model_len."""
    text: str | None = None
    """The prompt as text (echo)."""


@dataclass
class _Job:
    """One validated completions or chat request."""

    request_id: str
    model: str
    endpoint: str
    prompts: list[_Prompt]
    params: list[SamplingParams]
    n: int
    chat: bool
    echo: bool = False
    include_usage: bool = False
    top_logprobs: int = 0
    keep_logprobs: bool = True
    """False: logprobs were asked for only to rank best_of samples, not to return."""
    echo_top: int | None = None
    """Echo with logprobs: the top-N of each echoed prompt token (None: no echo logprobs)."""
    prompt_logprobs: int | None = None
    """The `prompt_logprobs` asked for (vLLM's answer field), None when not."""
    priority: int = 0


@dataclass
class _Usage:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add_prompt(self, i: int, out: RequestOutput) -> None:
        if i not in self.prompt_tokens:
            self.prompt_tokens[i] = len(out.prompt_token_ids or []) + len(
                out.encoder_prompt_token_ids or []
            )

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
        )


class _Ends:
    """Finish reasons of a stream's choices for the metrics: each as it finishes; an error
    ends the rest as errors, a stream closed early (the client left) ends them as aborts."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, num_choices: int) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.remaining = num_choices

    def add(self, outputs: list[CompletionOutput]) -> None:
        for c in outputs:
            if c.finish_reason is not None:
                self.metrics.observe_finish(self.endpoint, c.finish_reason)
                self.remaining -= 1

    def error(self) -> None:
        self.metrics.observe_finish(self.endpoint, "error", self.remaining)
        self.remaining = 0

    def abort_rest(self) -> None:
        self.metrics.observe_finish(self.endpoint, "abort", self.remaining)
        self.remaining = 0


def _engine_failed(error: str) -> APIError:
    lora_error = lora_unreadable_error(error)
    if lora_error is not None:
        return lora_error
    return APIError(500, f"the engine failed the request: {error}", code="engine_error")
