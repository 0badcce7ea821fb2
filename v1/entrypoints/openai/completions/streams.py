"""The streaming answers of `ServingCompletions`: server-sent completion and chat chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from v1.core.errors import EngineDeadError
from v1.entrypoints.openai.completions.job import _Ends, _engine_failed, _Job, _Usage
from v1.entrypoints.openai.completions.responses import CompletionResponses
from v1.entrypoints.openai.errors import bad_request, engine_dead_error
from v1.entrypoints.openai.logprobs import join
from v1.entrypoints.openai.metrics import RequestTimer
from v1.entrypoints.openai.protocol import (
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
)
from v1.entrypoints.openai.serving_engine import SSE_DONE, merge_streams, sse_error, sse_model
from v1.outputs import CompletionOutput, RequestOutput


class CompletionStreams:
    """Streaming responses (`data:` chunks ending with `data: [DONE]`); the echo and prompt
    logprobs come from `responses`, as in the non-streaming answers."""

    def __init__(self, responses: CompletionResponses) -> None:
        self.responses = responses
        self.metrics = responses.metrics
        self.logprobs = responses.logprobs

    def completion(
        self, job: _Job, streams: list[AsyncIterator[RequestOutput]], timer: RequestTimer
    ) -> AsyncIterator[str]:
        tally = _Tally(_Ends(self.metrics, job.endpoint, len(job.prompts) * job.n), timer)
        chunks = self._completion_chunks(job, tally.outputs(streams))
        return _framed(job, chunks, CompletionStreamResponse, tally)

    def chat(
        self, job: _Job, streams: list[AsyncIterator[RequestOutput]], timer: RequestTimer
    ) -> AsyncIterator[str]:
        tally = _Tally(_Ends(self.metrics, job.endpoint, job.n), timer)
        chunks = self._chat_stream(job, tally.outputs(streams))
        return _framed(job, chunks, ChatCompletionStreamResponse, tally)

    async def _completion_chunks(
        self, job: _Job, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        prompt_sent: set[int] = set()
        async for i, out in outputs:
            choices = []
            for c in out.outputs:
                index = i * job.n + c.index
                text = c.text
                prompt_lp = None
                if job.echo and index not in echoed:
                    echoed.add(index)
                    text = (job.prompts[i].text or "") + text
                    prompt_lp = self.responses.echo_logprobs(job, out, offsets, index)
                if not text and c.finish_reason is None:
                    continue
                logprobs = None
                if c.logprobs is not None:
                    logprobs = self.logprobs.completion(c, offsets, index)
                if prompt_lp is not None:
                    logprobs = join(prompt_lp, logprobs)
                prompt_entries = None
                if index not in prompt_sent and out.prompt_logprobs is not None:
                    prompt_sent.add(index)  # with the choice's first chunk
                    prompt_entries = self.responses.prompt_entries(job, out)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_entries,
                    )
                )
            if choices:
                yield sse_model(
                    CompletionStreamResponse(id=job.request_id, model=job.model, choices=choices)
                )

    async def _chat_stream(
        self, job: _Job, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        prompt_sent = False
        async for _, out in outputs:
            for choice in self._chat_chunks(job, out.outputs, started):
                prompt_entries = None
                if not prompt_sent and out.prompt_logprobs is not None:
                    prompt_sent = True  # with the first chunk
                    prompt_entries = self.responses.prompt_entries(job, out)
                yield sse_model(
                    ChatCompletionStreamResponse(
                        id=job.request_id,
                        model=job.model,
                        choices=[choice],
                        prompt_logprobs=prompt_entries,
                    )
                )

    def _chat_chunks(
        self, job: _Job, outputs: list[CompletionOutput], started: set[int]
    ) -> list[ChatStreamChoice]:
        chunks = []
        for c in outputs:
            if c.index not in started:
                started.add(c.index)
                delta = ChatDelta(role="assistant", content="")
                chunks.append(ChatStreamChoice(index=c.index, delta=delta))
            if c.text or (c.token_ids and c.logprobs is not None):
                chunks.append(
                    ChatStreamChoice(
                        index=c.index,
                        delta=ChatDelta(content=c.text),
                        logprobs=self.logprobs.chat(c, job.top_logprobs),
                    )
                )
            if c.finish_reason is not None:
                chunks.append(
                    ChatStreamChoice(
                        index=c.index, delta=ChatDelta(), finish_reason=c.finish_reason
                    )
                )
        return chunks


class _StreamFailed(Exception):
    """An output carried the engine's error for its request: the stream ends with it."""


class _Tally:
    """What a stream counts as its outputs pass: the finish and error metrics (`ends`), the
    token usage and the request's timer."""

    def __init__(self, ends: _Ends, timer: RequestTimer) -> None:
        self.ends = ends
        self.timer = timer
        self.usage = _Usage()

    async def outputs(
        self, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, counted; _StreamFailed at an engine error."""
        async for i, out in merge_streams(streams):
            if out.error is not None:
                raise _StreamFailed(out.error)
            self.ends.add(out.outputs)
            self.usage.add_prompt(i, out)
            num_new = sum(len(c.token_ids) for c in out.outputs)
            self.usage.completion_tokens += num_new
            self.timer.tokens(num_new)
            yield i, out


async def _framed(
    job: _Job,
    chunks: AsyncIterator[str],
    response: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse],
    tally: _Tally,
) -> AsyncIterator[str]:
    """An SSE answer: the endpoint's chunks, the usage chunk if asked for, then [DONE]; an
    engine failure or an input error ends it with an error event instead."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
        if job.include_usage:
            usage = tally.usage.info()
            yield sse_model(response(id=job.request_id, model=job.model, choices=[], usage=usage))
        yield SSE_DONE
    except _StreamFailed as e:
        tally.ends.error()
        yield sse_error(_engine_failed(e.args[0]))
    except EngineDeadError as e:
        tally.ends.error()
        yield sse_error(engine_dead_error(e))
    except ValueError as e:
        tally.ends.error()
        yield sse_error(bad_request(str(e)))
    finally:
        tally.ends.abort_rest()
        tally.timer.finish(sum(tally.usage.prompt_tokens.values()))
