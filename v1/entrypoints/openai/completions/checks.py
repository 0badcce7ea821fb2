"""Request checks that need no engine: logit_bias, the prompt list, stream options and the
OpenAI options this server rejects rather than silently ignores."""

from __future__ import annotations

from typing import Any

from v1.entrypoints.openai.completions.structured import _CONSTRAINT_FIELDS
from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.protocol import (
    MAX_BATCH_INPUTS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)


def _logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (string token ids) as ids -> biases, checked (400 naming it)."""
    if not body.logit_bias:
        return None
    bias = {}
    for key, value in body.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias value {value} for token {key} is outside [-100, 100]",
                param="logit_bias",
            )
        bias[token] = float(value)
    return bias


TOKENIZE_SLICE = 64
"""Prompts of one request tokenized per input-thread task (see `_completion_prompts`)."""


def _completion_items(prompt: Any) -> list[Any]:
    """The request's prompt as a list of prompts (text or token ids), checked for count."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > MAX_BATCH_INPUTS:
        raise bad_request(
            f"at most {MAX_BATCH_INPUTS} prompts per request, got {len(items)}", "prompt"
        )
    return items


def _check_stream_options(body: SamplingFields) -> None:
    """stream_options means something only for a stream (OpenAI answers 400 too)."""
    if body.stream_options is not None and not body.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _reject_with_beam_search(body: CompletionRequest) -> None:
    """use_beam_search keeps no grammar per beam, no prompt logprobs and no priority."""
    for name in (*_CONSTRAINT_FIELDS, "prompt_logprobs"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} cannot be combined with use_beam_search", param=name)
    if body.priority:
        raise bad_request("priority cannot be combined with use_beam_search", param="priority")


def _reject_unsupported_chat(body: ChatCompletionRequest) -> None:
    """400 naming each OpenAI option this server would otherwise silently ignore."""
    if body.tools:
        raise bad_request("tools (function calling) are not supported", param="tools")
    if body.functions:
        raise bad_request("functions (function calling) are not supported", param="functions")
    if body.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported (no function calling)", "tool_choice")
    if body.function_call not in (None, "none"):
        raise bad_request("function_call is not supported (no function calling)", "function_call")
    if body.parallel_tool_calls:
        raise bad_request(
            "parallel_tool_calls needs tools, which are not supported", "parallel_tool_calls"
        )
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise bad_request("output modalities other than 'text' are not supported", "modalities")
    for name in (
        "audio",
        "prediction",
        "web_search_options",
        "moderation",
        "reasoning_effort",
        "verbosity",
    ):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported", param=name)
    if body.store:
        raise bad_request("store is not supported (this server stores no completions)", "store")
    if body.metadata:
        raise bad_request("metadata is not supported (it goes with store)", param="metadata")
    if body.service_tier not in (None, "auto", "default"):
        raise bad_request(
            f"service_tier {body.service_tier!r} is not supported (only 'auto' and 'default')",
            param="service_tier",
        )
    if body.prompt_cache_retention not in (None, "in_memory"):
        raise bad_request(
            f"prompt_cache_retention {body.prompt_cache_retention!r} is not supported (the "
            "prefix cache is in memory only)",
            param="prompt_cache_retention",
        )
    if body.prompt_cache_options:
        raise bad_request(
            "prompt_cache_options is not supported (prefix caching is automatic)",
            param="prompt_cache_options",
        )
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request(
            "stream_options.include_obfuscation is not supported", param="stream_options"
        )
    for i, m in enumerate(body.messages):
        for name in ("tool_calls", "tool_call_id", "function_call", "audio", "refusal"):
            if getattr(m, name) is not None:
                raise bad_request(
                    f"messages[{i}].{name} is not supported (no function calling or audio)",
                    param=f"messages.{i}.{name}",
                )


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return 0
