"""Sampled-token logprobs in the two OpenAI shapes: the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset) and chat's per-token content entries.
"""

from __future__ import annotations

import math
from typing import Any

from v1.entrypoints.openai.protocol import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsOut,
)
from v1.outputs import CompletionOutput, PromptLogprobs

MIN_LOGPROB = -9999.0
"""Stands for -inf where the API wants a number (JSON has no infinity)."""


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, decoded: str | None) -> str:
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def completion(
        self, c: CompletionOutput, offsets: dict[int, int], index: int
    ) -> CompletionLogprobs:
        """Legacy completions logprobs; `offsets` carries each choice's text offset across
        streamed chunks."""
        out = CompletionLogprobs()
        pos = offsets.get(index, 0)
        for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=False):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled.decoded_token if sampled else None)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(sampled.logprob) if sampled else None)
            out.top_logprobs.append(
                {
                    self.token_text(t, lp.decoded_token): _logprob(lp.logprob)
                    for t, lp in entry.items()
                }
            )
            out.text_offset.append(pos)
            pos += len(text)
        offsets[index] = pos
        return out

    def prompt(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: PromptLogprobs | None,
        offsets: dict[int, int],
        index: int,
        num_top: int | None = None,
    ) -> CompletionLogprobs:
        """Legacy completions logprobs of an echoed prompt (the first token has none);
        `num_top`: keep the top-N of each position (None: all the engine computed)."""
        out = CompletionLogprobs()
        pos = offsets.get(index, 0)
        entries = prompt_logprobs or [None] * len(prompt_token_ids)
        for token_id, entry in zip(prompt_token_ids, entries, strict=False):
            own = entry.get(token_id) if entry else None
            if entry and num_top is not None:
                entry = _top(entry, token_id, num_top)
            text = self.token_text(token_id, own.decoded_token if own else None)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(own.logprob) if own else None)
            out.top_logprobs.append(
                {
                    self.token_text(t, lp.decoded_token): _logprob(lp.logprob)
                    for t, lp in entry.items()
                }
                if entry
                else None
            )
            out.text_offset.append(pos)
            pos += len(text)
        offsets[index] = pos
        return out

    def prompt_entries(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: PromptLogprobs | None,
        num_top: int,
    ) -> PromptLogprobsOut | None:
        """vLLM's `prompt_logprobs` answer: per prompt token, {id: logprob, rank, text} of the
        token itself and the top `num_top` (null for the first token)."""
        if prompt_logprobs is None:
            return None
        out: PromptLogprobsOut = []
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=False):
            if entry is None:
                out.append(None)
                continue
            out.append(
                {
                    str(t): PromptLogprob(
                        logprob=lp.logprob,
                        rank=lp.rank,
                        decoded_token=self.token_text(t, lp.decoded_token),
                    )
                    for t, lp in _top(entry, token_id, num_top).items()
                }
            )
        return out

    def chat(self, c: CompletionOutput, top_n: int) -> ChatLogprobs | None:
        if c.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=False):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled.decoded_token if sampled else None)
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                key=lambda item: item[1].rank or 0,
            )
            top = []
            for t, lp in ranked:
                tok = self.token_text(t, lp.decoded_token)
                top.append(
                    {"token": tok, "logprob": _logprob(lp.logprob), "bytes": list(tok.encode())}
                )
            content.append(
                ChatLogprobEntry(
                    token=text,
                    logprob=_logprob(sampled.logprob) if sampled else MIN_LOGPROB,
                    bytes=list(text.encode()),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)


def join(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    """An echoed prompt's logprobs followed by its completion's."""
    if then is None:
        return first
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def _top(entry: dict[int, Any], token_id: int, num_top: int) -> dict[int, Any]:
    """The prompt token's own entry and the entries ranked 1..num_top."""
    return {
        t: lp
        for t, lp in entry.items()
        if t == token_id or (lp.rank is not None and lp.rank <= num_top)
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB
