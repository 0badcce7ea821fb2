"""The first layer of `ServingCompletions`: prompts tokenized and checked against the context,
sampling parameters built and constrained."""

from __future__ import annotations

from typing import Any

from v1.entrypoints.openai.chat_template import ChatTemplate
from v1.entrypoints.openai.completions.checks import TOKENIZE_SLICE, _completion_items, _logit_bias
from v1.entrypoints.openai.completions.job import _Prompt
from v1.entrypoints.openai.completions.structured import _constraint_fields, _structured_outputs
from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from v1.entrypoints.openai.serving_engine import ServingBase
from v1.sampling_params import SamplingParams

_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class CompletionPrompts(ServingBase):
    """Validation: a request's prompts and sampling parameters (ServingCompletions sets
    `vocab_size` and `chat_template`)."""

    vocab_size: int
    chat_template: ChatTemplate | None

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
