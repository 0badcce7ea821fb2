"""The non-streaming answers of `ServingCompletions`: the finished outputs collected, then one
completion or chat body (echo and prompt logprobs included)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from v1.entrypoints.openai.completions.job import _engine_failed, _Job, _Usage
from v1.entrypoints.openai.errors import APIError
from v1.entrypoints.openai.logprobs import LogprobFormatter, join
from v1.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from v1.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from v1.entrypoints.openai.serving_engine import merge_streams
from v1.outputs import RequestOutput


class CompletionResponses:
    """Non-streaming responses, and the echo and prompt logprobs that streams share."""

    def __init__(self, metrics: ServerMetrics, logprobs: LogprobFormatter) -> None:
        self.metrics = metrics
        self.logprobs = logprobs

    async def collect(
        self, gens: list[AsyncIterator[RequestOutput]], timer: RequestTimer
    ) -> tuple[list[RequestOutput], _Usage]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        seen: dict[tuple[int, int], int] = {}
        usage = _Usage()
        async for i, out in merge_streams(gens):
            new = 0
            for c in out.outputs:
                key = (i, c.index)
                new += len(c.token_ids) - seen.get(key, 0)
                seen[key] = len(c.token_ids)
            timer.tokens(new)
            usage.add_prompt(i, out)
            finals[i] = out
        usage.completion_tokens = sum(seen.values())
        timer.finish(sum(usage.prompt_tokens.values()))
        for out in finals:
            if out is None or not out.finished:
                raise APIError(500, "a request ended without a result (it was aborted)")
            if out.error is not None:
                raise _engine_failed(out.error)
        for out in finals:
            for c in out.outputs:
                self.metrics.observe_finish(timer.endpoint, c.finish_reason)
        return finals, usage  # type: ignore[return-value]

    def completion(
        self, job: _Job, finals: list[RequestOutput], usage: _Usage
    ) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            outputs = sorted(out.outputs, key=lambda c: c.index)
            if len(outputs) > job.n:  # best_of > n: the n most likely samples
                outputs = sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[: job.n]
            for k, c in enumerate(outputs):
                text = (job.prompts[i].text or "") + c.text if job.echo else c.text
                offsets: dict[int, int] = {}
                prompt_lp = self.echo_logprobs(job, out, offsets, 0)
                logprobs = None
                if c.logprobs is not None and job.keep_logprobs:
                    logprobs = self.logprobs.completion(c, offsets, 0)
                if prompt_lp is not None:
                    logprobs = join(prompt_lp, logprobs)
                choices.append(
                    CompletionChoice(
                        index=i * job.n + k,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=self.prompt_entries(job, out),
                    )
                )
        return CompletionResponse(
            id=job.request_id, model=job.model, choices=choices, usage=usage.info()
        )

    def echo_logprobs(
        self, job: _Job, out: RequestOutput, offsets: dict[int, int], index: int
    ) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (echo with logprobs), else None."""
        if not job.echo or job.echo_top is None:
            return None
        return self.logprobs.prompt(
            out.prompt_token_ids or [], out.prompt_logprobs, offsets, index, job.echo_top
        )

    def prompt_entries(self, job: _Job, out: RequestOutput) -> Any:
        """vLLM's `prompt_logprobs` answer field when the request asked for it, else None."""
        if job.prompt_logprobs is None:
            return None
        return self.logprobs.prompt_entries(
            out.prompt_token_ids or [], out.prompt_logprobs, job.prompt_logprobs
        )

    def chat(self, job: _Job, finals: list[RequestOutput], usage: _Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=self.logprobs.chat(c, job.top_logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in sorted(finals[0].outputs, key=lambda c: c.index)
        ]
        return ChatCompletionResponse(
            id=job.request_id,
            model=job.model,
            choices=choices,
            usage=usage.info(),
            prompt_logprobs=self.prompt_entries(job, finals[0]),
        )
