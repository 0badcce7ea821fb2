"""Chat messages -> prompt text through the model's Jinja chat template, rendered in a sandbox
(`ImmutableSandboxedEnvironment`: templates from a model repository cannot reach Python objects
or mutate anything). A model without a template, or a template that fails, is the client's 400.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.protocol import ChatMessage
from v1.logger import init_logger

logger = init_logger(__name__)

_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def load_chat_template(tokenizer: Any, override: str | None) -> str | None:
    """The template text: `override` (a file path or the template itself), else the
    tokenizer's (its "default" one when it has several)."""
    if override:
        if os.path.isfile(override):
            with open(override, encoding="utf-8") as f:
                return f.read()
        return override
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


class ChatTemplate:
    """A compiled chat template and the tokenizer's special tokens it may refer to."""

    def __init__(self, tokenizer: Any, override: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.error: str | None = None
        self._template: jinja2.Template | None = None
        source = load_chat_template(tokenizer, override)
        if source is None:
            self.error = (
                "this model has no chat template (its tokenizer sets no chat_template), so "
                "/v1/chat/completions cannot format messages; use /v1/completions, or start the "
                "server with --chat-template"
            )
            return
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            self.error = f"the model's chat template does not compile: {e}"
            logger.warning("%s", self.error)

    def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; 400 when there is no usable template or rendering fails."""
        if self._template is None:
            raise bad_request(self.error or "no chat template", param="messages")
        extra = dict(extra or {})
        clash = _RESERVED_KWARGS & extra.keys()
        if clash:
            raise bad_request(
                f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs"
            )
        tok = self.tokenizer
        context = {
            "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "",
            "pad_token": getattr(tok, "pad_token", None) or "",
            "unk_token": getattr(tok, "unk_token", None) or "",
            **extra,
            "messages": [_message_dict(m, i) for i, m in enumerate(messages)],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
        }
        try:
            text = self._template.render(**context)
        except jinja2.TemplateError as e:  # SecurityError included
            raise bad_request(f"the chat template failed: {e}", param="messages") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise bad_request(
                f"the chat template failed on these messages: {type(e).__name__}: {e}",
                param="messages",
            ) from e
        if not text:
            raise bad_request("the chat template rendered an empty prompt", param="messages")
        return text


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _content_text(message, index)}
    if message.name is not None:
        out["name"] = message.name
    return out


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"messages[{index}]: content part of type {kind!r} is not supported (text only)",
                param=f"messages.{index}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)
