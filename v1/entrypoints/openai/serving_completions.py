"""/v1/completions and /v1/chat/completions over AsyncLLM.generate.

Prompts are tokenized here (decoder-only models) so that lengths are checked against the
context before anything runs; chat messages go through the sandboxed chat template. Responses are
one JSON body, or server-sent `data:` chunks ending with `data: [DONE]` when `stream` is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from v1.core.errors import EngineDeadError
from v1.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from v1.entrypoints.openai.chat_template import ChatTemplate
from v1.entrypoints.openai.errors import APIError, bad_request, engine_dead_error
from v1.entrypoints.openai.logprobs import LogprobFormatter, join
from v1.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from v1.entrypoints.openai.protocol import (
    MAX_BATCH_INPUTS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    SamplingFields,
    UsageInfo,
    random_id,
)
from v1.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ServerSettings,
    ServingBase,
    SSEResponse,
    close_all,
    json_response,
    lora_unreadable_error,
    map_input_errors,
    merge_streams,
    prime_all,
    run_until_disconnected,
    sse_error,
    sse_model,
)
from v1.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from v1.sampling_params import SamplingParams
from v1.structured_output import StructuredOutputsParams
from v1.structured_output.params import KINDS as STRUCTURED_KINDS

_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


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


class ServingCompletions(ServingBase):
    """Text generation endpoints of a decoder-only or text encoder-decoder model."""

    serves_lora = True

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        super().__init__(engine, settings, metrics)
        self.vocab_size: int = self.model_config.vocab_size
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.chat_template = (
            ChatTemplate(self.tokenizer, settings.chat_template) if self.is_generator else None
        )

    # ---- endpoints ----
    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        self._check_generator("/v1/completions")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of < body.n:
            raise bad_request("best_of must be >= n", param="best_of")
        best_of = body.best_of or body.n
        if (body.use_beam_search or best_of > body.n) and body.stream:
            raise bad_request("best_of > n and use_beam_search cannot stream", param="stream")
        if body.use_beam_search and best_of > MAX_BEAM_WIDTH:
            raise bad_request(f"beam search keeps at most {MAX_BEAM_WIDTH} beams", "best_of")
        if body.use_beam_search:
            _reject_with_beam_search(body)
        self._check_priority(body)
        _check_stream_options(body)
        if body.echo and body.logprobs is not None and not self.inputs.prompt_is_decoder_prompt:
            raise bad_request(
                "echo with logprobs needs a decoder-only model (the prompt here is the encoder's)",
                "echo",
            )
        prompts = await self._completion_prompts(body.prompt, body.truncate_prompt_tokens)
        if len(prompts) * body.n > MAX_BATCH_INPUTS:
            raise bad_request(
                f"{len(prompts)} prompts x n={body.n} is more than {MAX_BATCH_INPUTS} completions "
                "per request",
                param="n",
            )
        self.check_token_budget(sum(p.num_decoder_tokens for p in prompts) * body.n, "prompt")
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
        params = [
            self._sampling_params(body, p, body.max_tokens, explicit, body.logprobs, "prompt")
            for p in prompts
        ]
        if body.use_beam_search:
            return await self._beam_search(body, model, prompts, params, request)
        echo_top = body.logprobs if body.echo else None
        wanted = [v for v in (body.prompt_logprobs, echo_top) if v is not None]
        if wanted:
            params = [p.clone(prompt_logprobs=max(wanted)) for p in params]
        params = await self._with_structured_outputs(body, params)
        if best_of > body.n:
            # Sample best_of, return the n most likely (highest cumulative logprob).
            logprobs = 0 if body.logprobs is None else body.logprobs
            params = [p.clone(n=best_of, logprobs=logprobs) for p in params]
        job = _Job(
            random_id("cmpl"),
            model,
            "/v1/completions",
            prompts,
            params,
            body.n,
            chat=False,
            echo=body.echo,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            keep_logprobs=body.logprobs is not None,
            echo_top=echo_top,
            prompt_logprobs=body.prompt_logprobs,
            priority=body.priority,
        )
        return await self._run(job, body.stream, request)

    async def _beam_search(
        self,
        body: CompletionRequest,
        model: str,
        prompts: list[_Prompt],
        params: list[SamplingParams],
        request: Request,
    ) -> Response:
        """use_beam_search: best_of (default n) beams per prompt, the n best returned."""
        if body.logprobs is not None:
            raise bad_request("logprobs are not supported with use_beam_search", "logprobs")
        request_id = random_id("cmpl")
        try:
            beam_params = [
                BeamSearchParams(
                    beam_width=body.best_of or body.n,
                    max_tokens=p.max_tokens or 1,
                    length_penalty=body.length_penalty,
                    early_stopping=body.early_stopping,
                    num_return_sequences=body.n,
                    ignore_eos=body.ignore_eos,
                )
                for p in params
            ]
        except ValueError as e:
            raise bad_request(str(e), param="best_of") from e
        timer = RequestTimer(self.metrics, "/v1/completions")
        lora = self.lora_for(model)
        searches = [
            self.engine.beam_search(
                prompt.engine_prompt, bp, f"{request_id}-{i}", p.clone(n=1, stop=None), lora
            )
            for i, (prompt, bp, p) in enumerate(zip(prompts, beam_params, params, strict=True))
        ]
        results = await map_input_errors(run_until_disconnected(request, _gather(searches)))
        choices = []
        usage = UsageInfo()
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            usage.prompt_tokens += len(result.prompt_token_ids)
            for k, seq in enumerate(result.sequences):
                text = (prompt.text or "") + seq.text if body.echo else seq.text
                usage.completion_tokens = (usage.completion_tokens or 0) + len(seq.token_ids)
                timer.tokens(len(seq.token_ids))
                choices.append(
                    CompletionChoice(
                        index=i * body.n + k, text=text, finish_reason=seq.finish_reason
                    )
                )
                self.metrics.observe_finish(timer.endpoint, seq.finish_reason)
        usage.total_tokens = usage.prompt_tokens + (usage.completion_tokens or 0)
        timer.finish(usage.prompt_tokens)
        return json_response(
            CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        )

    async def create_chat_completion(
        self, body: ChatCompletionRequest, request: Request
    ) -> Response:
        model = self.check_model(body.model)
        self._check_generator("/v1/chat/completions")
        _reject_unsupported_chat(body)
        self._check_priority(body)
        _check_stream_options(body)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        num_chars = sum(_content_chars(m.content) for m in body.messages)
        self.check_chars(num_chars, "the messages", "messages")
        prompt = await self.offload(self._chat_prompt, body)
        self.check_token_budget(prompt.num_decoder_tokens * body.n, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(
            body, prompt, max_tokens, max_tokens is not None, logprobs, "messages"
        )
        if body.prompt_logprobs is not None:
            params = params.clone(prompt_logprobs=body.prompt_logprobs)
        (params,) = await self._with_structured_outputs(body, [params])
        job = _Job(
            random_id("chatcmpl"),
            model,
            "/v1/chat/completions",
            [prompt],
            [params],
            body.n,
            chat=True,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            top_logprobs=body.top_logprobs or 0,
            prompt_logprobs=body.prompt_logprobs,
            priority=body.priority,
        )
        return await self._run(job, body.stream, request)

    # ---- validation ----
    def _chat_prompt(self, body: ChatCompletionRequest) -> _Prompt:
        """The rendered and tokenized chat (on the input thread)."""
        assert self.chat_template is not None
        text = self.chat_template.render(
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            extra=body.chat_template_kwargs,
        )
        return self._text_prompt(text, False, body.truncate_prompt_tokens, "messages")

    def _check_priority(self, body: SamplingFields) -> None:
        """A priority means something only under the priority policy: else a 400, not a
        silently ignored field."""
        config = getattr(self.engine, "config", None)
        policy = getattr(getattr(config, "scheduler_config", None), "policy", "fcfs")
        if body.priority and policy != "priority":
            raise bad_request(
                f"priority is not supported by this server's scheduling policy ({policy!r}); "
                "start it with --scheduling-policy priority",
                param="priority",
            )

    def _check_generator(self, endpoint: str) -> None:
        if not self.is_generator:
            raise self.wrong_endpoint(endpoint, "a text generation model")

    async def _completion_prompts(self, prompt: Any, truncate: int | None) -> list[_Prompt]:
        """The prompts tokenized on the input thread, TOKENIZE_SLICE at a time: another
        request's tokenization queues between two slices of a huge batch, not behind all of it."""
        items = _completion_items(prompt)
        out: list[_Prompt] = []
        for start in range(0, len(items), TOKENIZE_SLICE):
            piece = items[start : start + TOKENIZE_SLICE]
            out += await self.offload(self._tokenize_items, piece, start, len(items), truncate)
        return out

    def _tokenize_items(
        self, items: list[Any], start: int, total: int, truncate: int | None
    ) -> list[_Prompt]:
        out = []
        for i, item in enumerate(items, start):
            where = "prompt" if total == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                out.append(self._text_prompt(item, True, truncate, where))
            else:
                out.append(self._ids_prompt(item, truncate, where))
        return out

    def _text_prompt(
        self, text: str, add_special_tokens: bool, truncate: int | None, where: str
    ) -> _Prompt:
        if not text:
            raise bad_request(f"{where} is an empty string", param=where.split("[")[0])
        self.check_chars(len(text), where, where.split("[")[0])
        if not self.inputs.prompt_is_decoder_prompt:
            # The encoder's input, tokenized by the engine: the decoder prompt is the builder's.
            return _Prompt(text, self.inputs.decoder_prompt_len(text), text)
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise bad_request(f"{where} is empty after tokenization", param=where.split("[")[0])
        if truncate is not None:
            ids = ids[-truncate:]
        return _Prompt({"prompt_token_ids": list(ids)}, len(ids), text)

    def _ids_prompt(self, ids: list[int], truncate: int | None, where: str) -> _Prompt:
        if not ids:
            raise bad_request(f"{where} is an empty list of token ids", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{where} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
                code="invalid_token_id",
            )
        num = min(len(ids), truncate) if truncate is not None else len(ids)
        text = self.tokenizer.decode(ids[-num:])
        engine_prompt = {"prompt_token_ids": list(ids)}
        return _Prompt(engine_prompt, self.inputs.decoder_prompt_len(engine_prompt, truncate), text)

    def _sampling_params(
        self,
        body: SamplingFields,
        prompt: _Prompt,
        max_tokens: int | None,
        explicit: bool,
        logprobs: int | None,
        prompt_param: str,
    ) -> SamplingParams:
        room = self.max_model_len - prompt.num_decoder_tokens
        if room < 1:
            raise bad_request(
                f"the prompt has {prompt.num_decoder_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens, which leaves no room to generate",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            if explicit:
                raise bad_request(
                    f"this model's maximum context length is {self.max_model_len} tokens; you "
                    f"requested {prompt.num_decoder_tokens + max_tokens} tokens "
                    f"({prompt.num_decoder_tokens} in the prompt, {max_tokens} for the "
                    "completion). Reduce the prompt or max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            max_tokens = room
        kwargs: dict[str, Any] = {
            name: getattr(body, name)
            for name in _OPTIONAL_SAMPLING_FIELDS
            if getattr(body, name) is not None
        }
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        try:
            return SamplingParams(
                n=body.n,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                seed=body.seed,
                stop=stop or None,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                logprobs=logprobs,
                logit_bias=_logit_bias(body, self.vocab_size),
                **kwargs,
            )
        except ValueError as e:
            field_name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field_name) from e

    async def _with_structured_outputs(
        self, body: SamplingFields, params: list[SamplingParams]
    ) -> list[SamplingParams]:
        """`params` constrained by response_format, guided_* or structured_outputs (at most
        one; compiled once, off the event loop), or unchanged for none / text."""
        names = _constraint_fields(body)
        if not names:
            return params
        structured = await self.offload(_structured_outputs, body)
        if structured is None:
            return params
        if body.ignore_eos:
            raise bad_request(f"{names[0]} cannot be used with ignore_eos", "ignore_eos")
        if body.min_tokens:
            raise bad_request(f"{names[0]} cannot be used with min_tokens", "min_tokens")
        return [p.clone(structured_outputs=structured) for p in params]

    # ---- running ----
    async def _run(self, job: _Job, stream: bool, request: Request) -> Response:
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.CUMULATIVE
        gens = [
            self.engine.generate(
                p.engine_prompt,
                params,
                f"{job.request_id}-{i}",
                output_kind=kind,
                priority=job.priority,
                lora_request=self.lora_for(job.model),
            )
            for i, (p, params) in enumerate(zip(job.prompts, job.params, strict=True))
        ]
        timer = RequestTimer(self.metrics, job.endpoint)
        if stream:
            streams = await map_input_errors(prime_all(request, gens))
            make = self._stream_chat if job.chat else self._stream_completion
            return SSEResponse(
                make(job, streams, timer), on_close=partial(close_all, [*streams, *gens])
            )
        finals, usage = await map_input_errors(
            run_until_disconnected(request, self._collect(gens, timer))
        )
        if job.chat:
            return json_response(self._chat_response(job, finals, usage))
        return json_response(self._completion_response(job, finals, usage))

    async def _collect(
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

    # ---- responses ----
    def _completion_response(
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
                prompt_lp = self._echo_logprobs(job, out, offsets, 0)
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
                        prompt_logprobs=self._prompt_entries(job, out),
                    )
                )
        return CompletionResponse(
            id=job.request_id, model=job.model, choices=choices, usage=usage.info()
        )

    def _echo_logprobs(
        self, job: _Job, out: RequestOutput, offsets: dict[int, int], index: int
    ) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (echo with logprobs), else None."""
        if not job.echo or job.echo_top is None:
            return None
        return self.logprobs.prompt(
            out.prompt_token_ids or [], out.prompt_logprobs, offsets, index, job.echo_top
        )

    def _prompt_entries(self, job: _Job, out: RequestOutput) -> Any:
        """vLLM's `prompt_logprobs` answer field when the request asked for it, else None."""
        if job.prompt_logprobs is None:
            return None
        return self.logprobs.prompt_entries(
            out.prompt_token_ids or [], out.prompt_logprobs, job.prompt_logprobs
        )

    def _chat_response(
        self, job: _Job, finals: list[RequestOutput], usage: _Usage
    ) -> ChatCompletionResponse:
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
            prompt_logprobs=self._prompt_entries(job, finals[0]),
        )

    async def _stream_completion(
        self, job: _Job, streams: list[AsyncIterator[RequestOutput]], timer: RequestTimer
    ) -> AsyncIterator[str]:
        usage = _Usage()
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        prompt_sent: set[int] = set()
        ends = _Ends(self.metrics, job.endpoint, len(job.prompts) * job.n)
        try:
            async for i, out in merge_streams(streams):
                if out.error is not None:
                    ends.error()
                    yield sse_error(_engine_failed(out.error))
                    return
                ends.add(out.outputs)
                usage.add_prompt(i, out)
                num_new = sum(len(c.token_ids) for c in out.outputs)
                usage.completion_tokens += num_new
                timer.tokens(num_new)
                choices = []
                for c in out.outputs:
                    index = i * job.n + c.index
                    text = c.text
                    prompt_lp = None
                    if job.echo and index not in echoed:
                        echoed.add(index)
                        text = (job.prompts[i].text or "") + text
                        prompt_lp = self._echo_logprobs(job, out, offsets, index)
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
                        prompt_entries = self._prompt_entries(job, out)
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
                        CompletionStreamResponse(
                            id=job.request_id, model=job.model, choices=choices
                        )
                    )
            if job.include_usage:
                yield sse_model(
                    CompletionStreamResponse(
                        id=job.request_id, model=job.model, choices=[], usage=usage.info()
                    )
                )
            yield SSE_DONE
        except EngineDeadError as e:
            ends.error()
            yield sse_error(engine_dead_error(e))
        except ValueError as e:
            ends.error()
            yield sse_error(bad_request(str(e)))
        finally:
            ends.abort_rest()
            timer.finish(sum(usage.prompt_tokens.values()))

    async def _stream_chat(
        self, job: _Job, streams: list[AsyncIterator[RequestOutput]], timer: RequestTimer
    ) -> AsyncIterator[str]:
        usage = _Usage()
        started: set[int] = set()
        prompt_sent = False
        ends = _Ends(self.metrics, job.endpoint, job.n)
        try:
            async for _, out in merge_streams(streams):
                if out.error is not None:
                    ends.error()
                    yield sse_error(_engine_failed(out.error))
                    return
                ends.add(out.outputs)
                usage.add_prompt(0, out)
                num_new = sum(len(c.token_ids) for c in out.outputs)
                usage.completion_tokens += num_new
                timer.tokens(num_new)
                for choice in self._chat_chunks(job, out.outputs, started):
                    prompt_entries = None
                    if not prompt_sent and out.prompt_logprobs is not None:
                        prompt_sent = True  # with the first chunk
                        prompt_entries = self._prompt_entries(job, out)
                    yield sse_model(
                        ChatCompletionStreamResponse(
                            id=job.request_id,
                            model=job.model,
                            choices=[choice],
                            prompt_logprobs=prompt_entries,
                        )
                    )
            if job.include_usage:
                yield sse_model(
                    ChatCompletionStreamResponse(
                        id=job.request_id, model=job.model, choices=[], usage=usage.info()
                    )
                )
            yield SSE_DONE
        except EngineDeadError as e:
            ends.error()
            yield sse_error(engine_dead_error(e))
        except ValueError as e:
            ends.error()
            yield sse_error(bad_request(str(e)))
        finally:
            ends.abort_rest()
            timer.finish(sum(usage.prompt_tokens.values()))

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


_CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
"""Request fields that constrain the output (at most one per request)."""


def _constraint_fields(body: SamplingFields) -> list[str]:
    """The constraint fields the request sets (a text response_format is none)."""
    names = [n for n in _CONSTRAINT_FIELDS if getattr(body, n) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") == "text":
        names.remove("response_format")
    return names


def _structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint (response_format, guided_*, structured_outputs) as
    StructuredOutputsParams, None for none / text; 400 naming the field for two constraints, an
    unknown kind or one llguidance cannot compile."""
    names = _constraint_fields(body)
    if not names:
        return None
    if len(names) > 1:
        raise bad_request(
            f"at most one of {', '.join(_CONSTRAINT_FIELDS)} may be given; got {', '.join(names)}",
            param=names[1],
        )
    name = names[0]
    try:
        params = _constraint(body, name)
        params.validate()
    except ValueError as e:
        message = str(e)
        if name.startswith("guided_"):
            message = message.replace(f"structured_outputs.{name[len('guided_') :]}", name)
        raise bad_request(message, param=name) from e
    return params


def _constraint(body: SamplingFields, name: str) -> StructuredOutputsParams:
    if name == "guided_json":
        assert body.guided_json is not None
        return StructuredOutputsParams(json=body.guided_json)
    if name == "guided_regex":
        return StructuredOutputsParams(regex=body.guided_regex)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=body.guided_choice)
    if name == "guided_grammar":
        return StructuredOutputsParams(grammar=body.guided_grammar)
    if name == "structured_outputs":
        spec = body.structured_outputs or {}
        unknown = [k for k in spec if k not in STRUCTURED_KINDS]
        if unknown:
            raise ValueError(
                f"structured_outputs.{unknown[0]} is not supported (supported: "
                f"{', '.join(STRUCTURED_KINDS)})"
            )
        try:
            return msgspec.convert(spec, StructuredOutputsParams)
        except msgspec.ValidationError as e:
            raise ValueError(f"structured_outputs: {e}") from e
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                "response_format json_schema needs {'json_schema': {'name': ..., "
                "'schema': {...}}} with the schema as a JSON object"
            )
        try:
            return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})
        except ValueError as e:
            raise ValueError(str(e).replace("structured_outputs.json", "response_format")) from e
    raise ValueError(
        f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


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


def _engine_failed(error: str) -> APIError:
    lora_error = lora_unreadable_error(error)
    if lora_error is not None:
        return lora_error
    return APIError(500, f"the engine failed the request: {error}", code="engine_error")


async def _gather(coros: list[Any]) -> list[Any]:
    """asyncio.gather that cancels the others (aborting their engine requests) if one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
