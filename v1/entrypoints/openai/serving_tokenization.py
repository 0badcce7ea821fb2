"""/tokenize and /detokenize (vLLM's extensions): the model's tokenizer over HTTP.

A prompt, or chat messages rendered by the same sandboxed chat template as chat completions, to
token ids (and their strings); token ids back to text. The work runs on the input thread, after
the character limit.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from v1.entrypoints.openai.chat_template import ChatTemplate
from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from v1.entrypoints.openai.serving_engine import ServerSettings, ServingBase, json_response


class ServingTokenization(ServingBase):
    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        super().__init__(engine, settings, metrics)
        self.vocab_size: int = self.model_config.vocab_size
        self.chat_template = (
            ChatTemplate(self.tokenizer, settings.chat_template) if self.is_generator else None
        )

    async def tokenize(self, body: TokenizeRequest) -> Response:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if self.chat_template is None:
                raise self.wrong_endpoint("/tokenize with messages", "a chat (generating) model")
            num_chars = sum(len(str(m.content or "")) for m in body.messages)
            self.check_chars(num_chars, "the messages", "messages")
        else:
            assert body.prompt is not None
            self.check_chars(len(body.prompt), "prompt", "prompt")
        ids, strs = await self.offload(self._tokenize, body)
        return json_response(
            TokenizeResponse(
                count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
            )
        )

    def _tokenize(self, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if body.messages is not None:
            assert self.chat_template is not None
            text = self.chat_template.render(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                extra=body.chat_template_kwargs,
            )
            add_special_tokens = False  # the template writes them
        else:
            text, add_special_tokens = body.prompt or "", body.add_special_tokens
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return ids, strs

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        self.check_model(body.model)
        bad = [t for t in body.tokens if t >= self.vocab_size]
        if bad:
            raise bad_request(
                f"tokens holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                param="tokens",
                code="invalid_token_id",
            )
        text = await self.offload(self.tokenizer.decode, body.tokens)
        return json_response(DetokenizeResponse(prompt=text))
