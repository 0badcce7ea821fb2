"""Chat conversations -> token-id prompts for `LLM.chat`, through the tokenizer's chat template
(transformers' `apply_chat_template`, which renders in a Jinja sandbox) or one given as text or
a file. The rendered text carries the template's special tokens, so it is tokenized without
adding more (as the server's /v1/chat/completions does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message"})


def conversations(messages: Any) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations")
    convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for i, conv in enumerate(convs):
        if (
            not isinstance(conv, Sequence)
            or isinstance(conv, str)
            or not conv
            or not all(isinstance(m, Mapping) and "role" in m for m in conv)
        ):
            raise ValueError(
                f"conversation {i}: expected a non-empty list of messages, each a dict with a "
                "'role' and 'content'"
            )
    return convs


def read_template(chat_template: str | None) -> str | None:
    """A template given as a file path, or as the template text itself."""
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    return chat_template


def chat_prompt_ids(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The conversation rendered by the template (`chat_template` text, else the tokenizer's)
    and tokenized; ValueError when there is no template or it fails on these messages."""
    extra = dict(chat_template_kwargs or {})
    clash = _RESERVED_KWARGS & extra.keys()
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template: pass chat_template= (Jinja text or a "
            "file), or use generate() with a prompt"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in conversation],
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e
    if not text:
        raise ValueError("the chat template rendered an empty prompt")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the chat prompt is empty after tokenization")
    return list(ids)
