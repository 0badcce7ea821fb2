"""v1-engine: a vLLM-V1-style serving engine for encoder-decoder, encoder-only and decoder-only
transformers. The public API is imported lazily, so `import v1` stays cheap (no torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from v1.version import __version__

_LAZY = {
    "LLM": "v1.entrypoints.llm",
    "AsyncLLM": "v1.engine.async_llm",
    "LLMEngine": "v1.engine.llm_engine",
    "SamplingParams": "v1.sampling_params",
    "StructuredOutputsParams": "v1.structured_output",
    "LoRARequest": "v1.lora_request",
    "PoolingParams": "v1.pooling_params",
    "BeamSearchParams": "v1.engine.beam_search",
    "BeamSearchOutput": "v1.engine.beam_search",
    "BeamSearchSequence": "v1.engine.beam_search",
    "EngineConfig": "v1.config",
    "RequestOutput": "v1.outputs",
    "CompletionOutput": "v1.outputs",
    "Logprob": "v1.outputs",
    "RequestOutputKind": "v1.outputs",
    "PoolingRequestOutput": "v1.outputs",
    "EmbeddingOutput": "v1.outputs",
    "EmbeddingRequestOutput": "v1.outputs",
    "ClassificationOutput": "v1.outputs",
    "ClassificationRequestOutput": "v1.outputs",
    "ScoringOutput": "v1.outputs",
    "ScoringRequestOutput": "v1.outputs",
    "RerankResult": "v1.outputs",
    "PromptType": "v1.inputs",
    "TextPrompt": "v1.inputs",
    "TokensPrompt": "v1.inputs",
    "ExplicitEncoderDecoderPrompt": "v1.inputs",
}

__all__ = [
    "__version__",
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "PoolingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestOutputKind",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "RerankResult",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "ExplicitEncoderDecoderPrompt",
]

if TYPE_CHECKING:
    from v1.config import EngineConfig
    from v1.engine.async_llm import AsyncLLM
    from v1.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from v1.engine.llm_engine import LLMEngine
    from v1.entrypoints.llm import LLM
    from v1.inputs import ExplicitEncoderDecoderPrompt, PromptType, TextPrompt, TokensPrompt
    from v1.lora_request import LoRARequest
    from v1.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        RequestOutputKind,
        RerankResult,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from v1.pooling_params import PoolingParams
    from v1.sampling_params import SamplingParams
    from v1.structured_output import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'v1' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
