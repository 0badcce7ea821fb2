"""Sampled-token logprobs in the two OpenAI shapes: the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset) and chat's per-token content entries.
"""

from __future__ import annotations

import math
from typing import Any

from v1.entrypoints.openai.protocol import ChatLogprobEntry, ChatLogprobs, CompletionLogprobs
from v1.outputs import CompletionOutput

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


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB
