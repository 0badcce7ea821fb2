"""/v1/completions and /v1/chat/completions over AsyncLLM.generate.

Prompts are tokenized here (decoder-only models) so that lengths are checked against the
context before anything runs; chat messages go through the sandboxed chat template. Responses are
one JSON body, or server-sent `data:` chunks ending with `data: [DONE]` when `stream` is set.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from v1.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from v1.entrypoints.openai.chat_template import ChatTemplate
from v1.entrypoints.openai.completions.checks import (
    TOKENIZE_SLICE,
    _check_stream_options,
    _content_chars,
    _reject_unsupported_chat,
    _reject_with_beam_search,
)
from v1.entrypoints.openai.completions.job import _Job, _Prompt
from v1.entrypoints.openai.completions.prompts import CompletionPrompts
from v1.entrypoints.openai.completions.responses import CompletionResponses
from v1.entrypoints.openai.completions.streams import CompletionStreams
from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.logprobs import LogprobFormatter
from v1.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from v1.entrypoints.openai.protocol import (
    MAX_BATCH_INPUTS,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from v1.entrypoints.openai.serving_engine import (
    ServerSettings,
    SSEResponse,
    close_all,
    json_response,
    map_input_errors,
    prime_all,
    run_until_disconnected,
)
from v1.outputs import RequestOutputKind
from v1.sampling_params import SamplingParams

__all__ = ["TOKENIZE_SLICE", "ServingCompletions"]


class ServingCompletions(CompletionPrompts):
    """Text generation endpoints of a decoder-only or text encoder-decoder model: the request
    checks and prompts here and in `CompletionPrompts`; the answers in `responses` (one JSON
    body) and `streams` (server-sent chunks)."""

    serves_lora = True

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        super().__init__(engine, settings, metrics)
        self.vocab_size: int = self.model_config.vocab_size
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.responses = CompletionResponses(self.metrics, self.logprobs)
        self.streams = CompletionStreams(self.responses)
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
                # A non-streamed response reads only the last output (the metrics read every
                # one as it comes): such requests may run in decode bursts.
                streamed=stream,
            )
            for i, (p, params) in enumerate(zip(job.prompts, job.params, strict=True))
        ]
        timer = RequestTimer(self.metrics, job.endpoint)
        if stream:
            streams = await map_input_errors(prime_all(request, gens))
            make = self.streams.chat if job.chat else self.streams.completion
            return SSEResponse(
                make(job, streams, timer), on_close=partial(close_all, [*streams, *gens])
            )
        finals, usage = await map_input_errors(
            run_until_disconnected(request, self.responses.collect(gens, timer))
        )
        if job.chat:
            return json_response(self.responses.chat(job, finals, usage))
        return json_response(self.responses.completion(job, finals, usage))


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
