"""Pooling parameters of an encoder-only request (embed, classify, score).

A msgspec Struct that crosses the process boundary as it is; checked against `ModelInfo`
at the frontend and again at admission.
"""

from __future__ import annotations

import msgspec

POOLING_TASKS = ("embed", "classify", "score", "encode")


class PoolingParamsError(ValueError):
    """PoolingParams the model cannot serve; `param` names the field at fault ("model" when
    the task itself needs another model), for the server's 400 body."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    task: str = "embed"
    """embed (pooled + normalized vector), classify (head logits/probabilities), score
    (cross-encoder relevance), encode (per-token hidden states)."""
    dimensions: int | None = None
    """Matryoshka truncation of the embedding (models that support it only)."""
    normalize: bool | None = None
    """L2-normalize embeddings; None: the model's default (sentence-transformers Normalize)."""
    activation: bool | None = None
    """Apply sigmoid/softmax to classification logits; None: the model's default."""
    truncate_prompt_tokens: int | None = None
    """Keep only the first N tokens (over-long input without it is an error)."""

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )

    def clone(self, **changes: object) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)
