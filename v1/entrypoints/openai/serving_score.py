"""/v1/score and /v1/rerank (vLLM / Cohere bodies) over AsyncLLM.encode.

A cross-encoder (sequence classification model with one label) scores each (query, document)
pair in one pass; an embedding model scores the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from v1.entrypoints.openai.errors import bad_request
from v1.entrypoints.openai.protocol import (
    MAX_BATCH_INPUTS,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
    random_id,
)
from v1.entrypoints.openai.serving_embeddings import ServingPooling
from v1.entrypoints.openai.serving_engine import json_response


class ServingScore(ServingPooling):
    @property
    def is_cross_encoder(self) -> bool:
        return "classify" in self.model_info.supported_tasks

    async def create_score(self, body: ScoreRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        self._check_kind("/v1/score")
        left = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
        right = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if not left or not right:
            raise bad_request("text_1 and text_2 must not be empty", param="text_1")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise bad_request(
                f"text_1 and text_2 pair one to one (or text_1 is one text): got {len(left)} "
                f"and {len(right)} texts",
                param="text_2",
            )
        scores, num_tokens = await self._scores(
            request, list(zip(left, right, strict=True)), body.truncate_prompt_tokens, "text_1"
        )
        usage = UsageInfo(prompt_tokens=num_tokens, completion_tokens=None, total_tokens=num_tokens)
        self.metrics.observe_finish("/v1/score", "stop", len(scores))
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return json_response(
            ScoreResponse(id=random_id("score"), model=model, data=data, usage=usage)
        )

    async def create_rerank(self, body: RerankRequest, request: Request) -> Response:
        model = self.check_model(body.model)
        self._check_kind("/v1/rerank")
        docs = [d.text if isinstance(d, RerankDocument) else d for d in body.documents]
        if not docs:
            raise bad_request("documents must not be empty", param="documents")
        if not body.query:
            raise bad_request("query is an empty string", param="query")
        scores, num_tokens = await self._scores(
            request, [(body.query, d) for d in docs], body.truncate_prompt_tokens, "documents"
        )
        self.metrics.observe_finish("/v1/rerank", "stop", len(scores))
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if body.top_n is not None:
            order = order[: body.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=docs[i]) if body.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        return json_response(
            RerankResponse(
                id=random_id("rerank"),
                model=model,
                usage=RerankUsage(total_tokens=num_tokens),
                results=results,
            )
        )

    def _check_kind(self, endpoint: str) -> None:
        if not self.is_pooling:
            raise self.wrong_endpoint(endpoint, "a cross-encoder or embedding model")

    async def _scores(
        self,
        request: Request,
        pairs: list[tuple[str, str]],
        truncate: int | None,
        param: str,
    ) -> tuple[list[float], int]:
        """(score per pair, prompt tokens used)."""
        if len(pairs) > MAX_BATCH_INPUTS:
            raise bad_request(f"at most {MAX_BATCH_INPUTS} pairs per request", param=param)
        request_id = random_id("score")
        if self.is_cross_encoder:
            params = self.pooling_params("model", task="score")
            prompts = await self.offload(self.text_inputs, pairs, truncate, param)
            outputs = await self.run_pooling(request, prompts, params, request_id, param)
            scores = [float(np.asarray(o.outputs.data).reshape(-1)[0]) for o in outputs]
            self.metrics.prompt_tokens.inc(sum(len(o.prompt_token_ids) for o in outputs))
            return scores, sum(len(o.prompt_token_ids) for o in outputs)
        # Bi-encoder: embed every distinct text once, then the cosine of each pair.
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        params = self.pooling_params("model", task="embed")
        prompts = await self.offload(self.text_inputs, texts, truncate, param)
        outputs = await self.run_pooling(request, prompts, params, request_id, param)
        vectors = {
            t: np.asarray(o.outputs.data, dtype=np.float32).reshape(-1)
            for t, o in zip(texts, outputs, strict=True)
        }
        scores = []
        for a, b in pairs:
            u, v = vectors[a], vectors[b]
            denom = max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12)
            scores.append(float(np.dot(u, v)) / denom)
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        self.metrics.prompt_tokens.inc(num_tokens)
        return scores, num_tokens
