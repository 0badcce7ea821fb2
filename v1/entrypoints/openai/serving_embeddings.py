"""/v1/embeddings over AsyncLLM.encode, and the pooling plumbing that /v1/score and /v1/rerank
share: inputs tokenized and length-checked here (the sentence-transformers max_seq_length
included), requests run together (the engine's input processor checks the pooling params
against the model: a 400 naming the field).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from v1.entrypoints.openai.errors import APIError, bad_request
from v1.entrypoints.openai.metrics import ServerMetrics
from v1.entrypoints.openai.protocol import (
    MAX_BATCH_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageInfo,
    random_id,
)
from v1.entrypoints.openai.serving_engine import (
    ServerSettings,
    ServingBase,
    gather_or_cancel,
    json_response,
    map_input_errors,
    run_until_disconnected,
)
from v1.outputs import PoolingRequestOutput
from v1.pooling_params import PoolingParams


class ServingPooling(ServingBase):
    """Shared by the pooling endpoints: input checks and running a batch of pooling requests."""

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics) -> None:
        super().__init__(engine, settings, metrics)
        self.max_input_len: int = self.inputs.max_encoder_len
        """The longest input the engine takes (the model's and sentence-transformers' limits
        and the per-step token budget), as the input builder holds it."""

    def pooling_params(self, param: str, **kwargs: Any) -> PoolingParams:
        """PoolingParams (400 naming `param` when they are invalid in themselves); what the
        model cannot do is refused where the engine checks them, once per request."""
        try:
            return PoolingParams(**kwargs)
        except ValueError as e:
            raise bad_request(str(e), param=param) from e

    def check_ids(self, ids: list[int], where: str, param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{where} is empty", param=param)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"{where} holds token id {bad[0]}, outside the vocabulary [0, {vocab})",
                param=param,
                code="invalid_token_id",
            )
        return ids

    def check_length(self, num_tokens: int, where: str, param: str) -> None:
        if num_tokens > self.max_input_len:
            raise bad_request(
                f"{where} has {num_tokens} tokens, more than this model's limit of "
                f"{self.max_input_len} (set truncate_prompt_tokens to truncate it)",
                param=param,
                code="context_length_exceeded",
            )

    def text_inputs(
        self, texts: list[str] | list[tuple[str, str]], truncate: int | None, param: str
    ) -> list[dict[str, Any]]:
        """Token prompts of texts, or of text pairs when `texts` holds tuples."""
        for i, text in enumerate(texts):
            parts = text if isinstance(text, tuple) else (text,)
            if any(not t for t in parts):
                raise bad_request(f"{param}[{i}] is an empty string", param=param)
            self.check_chars(sum(len(t) for t in parts), f"{param}[{i}]", param)
        limit = min(truncate, self.max_input_len) if truncate is not None else None
        prompts = []
        for i, text in enumerate(texts):
            parts = text if isinstance(text, tuple) else (text,)
            if limit is None:
                enc = self.tokenizer(*parts)
            else:
                enc = self.tokenizer(*parts, truncation=True, max_length=limit)
            ids = list(enc["input_ids"])
            self.check_length(len(ids), f"{param}[{i}]", param)
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if isinstance(text, tuple) and enc.get("token_type_ids") is not None:
                prompt["token_type_ids"] = list(enc["token_type_ids"])
            prompts.append(prompt)
        return prompts

    async def run_pooling(
        self,
        request: Request,
        prompts: list[dict[str, Any]],
        params: PoolingParams,
        request_id: str,
        param: str,
    ) -> list[PoolingRequestOutput]:
        """The outputs of every prompt, in order; the client leaving aborts them all. The
        prompts' tokens count against --max-tokens-per-request (400 naming `param`)."""
        self.check_token_budget(sum(len(p["prompt_token_ids"]) for p in prompts), param)
        if len(prompts) > 1 and params.task != "encode":
            # One client request's inputs go to the core packed (a few core requests).
            packed = self.engine.encode_packed(prompts, params, request_id)
            outputs: list[Any] = await map_input_errors(run_until_disconnected(request, packed))
        else:
            outputs = await self._one_by_one(request, prompts, params, request_id)
        for out in outputs:
            if out is None or out.outputs is None:
                error = out.error if out is not None else "no output"
                raise APIError(500, f"the engine failed the request: {error}", code="engine_error")
            if out.error is not None:
                raise APIError(
                    500, f"the engine failed the request: {out.error}", code="engine_error"
                )
        return outputs

    async def _one_by_one(
        self,
        request: Request,
        prompts: list[dict[str, Any]],
        params: PoolingParams,
        request_id: str,
    ) -> list[PoolingRequestOutput | None]:
        async def one(i: int, prompt: dict[str, Any]) -> PoolingRequestOutput | None:
            final = None
            async for out in self.engine.encode(prompt, params, f"{request_id}-{i}"):
                final = out
            return final

        return await map_input_errors(
            run_until_disconnected(
                request, gather_or_cancel([one(i, p) for i, p in enumerate(prompts)])
            )
        )


class ServingEmbeddings(ServingPooling):
    async def create_embedding(self, body: EmbeddingRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        if not self.is_pooling:
            raise self.wrong_endpoint("/v1/embeddings", "an embedding (encoder-only) model")
        prompts, id_inputs = await self.offload(
            self._inputs, body.input, body.truncate_prompt_tokens
        )
        truncate = body.truncate_prompt_tokens if id_inputs else None
        if truncate is not None:
            truncate = min(truncate, self.max_input_len)
        params = self.pooling_params(
            "dimensions", task="embed", dimensions=body.dimensions, truncate_prompt_tokens=truncate
        )
        outputs = await self.run_pooling(request, prompts, params, random_id("embd"), "input")
        data = []
        num_tokens = 0
        for i, out in enumerate(outputs):
            vector = np.asarray(out.outputs.data, dtype=np.float32).reshape(-1)
            data.append(EmbeddingData(index=i, embedding=_encode(vector, body.encoding_format)))
            num_tokens += len(out.prompt_token_ids)
        self.metrics.prompt_tokens.inc(num_tokens)
        self.metrics.observe_finish("/v1/embeddings", "stop", len(outputs))
        usage = UsageInfo(prompt_tokens=num_tokens, completion_tokens=None, total_tokens=num_tokens)
        return json_response(EmbeddingResponse(data=data, model=model, usage=usage))

    def _inputs(self, value: Any, truncate: int | None) -> tuple[list[dict[str, Any]], bool]:
        """(token prompts, whether the input was token ids)."""
        if isinstance(value, str):
            items: list[Any] = [value]
        elif value and isinstance(value[0], int):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise bad_request("input must not be empty", param="input")
        if len(items) > MAX_BATCH_INPUTS:
            raise bad_request(
                f"at most {MAX_BATCH_INPUTS} inputs per request, got {len(items)}", param="input"
            )
        if isinstance(items[0], str):
            return self.text_inputs(items, truncate, "input"), False
        prompts = []
        for i, ids in enumerate(items):
            ids = self.check_ids(list(ids), f"input[{i}]", "input")
            if truncate is None:
                self.check_length(len(ids), f"input[{i}]", "input")
            prompts.append({"prompt_token_ids": ids})
        return prompts, True


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
