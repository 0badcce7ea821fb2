"""What the worker calls on a model, as typing Protocols. Each model-kind state names the
protocols it needs and `require` checks them once, when the model is loaded: a model without
one fails at start-up with the missing names, never mid-step or through a `getattr` fallback.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ModelForward(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """Packed tokens [T] and their positions [T] -> hidden states [T, hidden]."""
        ...


class SupportsLogits(ModelForward, Protocol):
    """A generating model (decoder-only or encoder-decoder)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> logits [N, >= vocab_size]."""
        ...


class SupportsEncode(Protocol):
    """An encoder-decoder model's encoder: token ids and positions (BART, T5) or 16 kHz
    waveforms (Whisper) -> packed encoder outputs [sum of encoder lengths, hidden]."""

    def encode(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


class SupportsWhisper(SupportsEncode, SupportsLogits, Protocol):
    """Whisper: the cross-attention of its alignment heads (word timestamps). Its special
    tokens are model facts (`ModelInfo.whisper_tokens`), not model attributes."""

    def alignment_attention(
        self,
        token_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        alignment_heads: Any,
    ) -> torch.Tensor:
        """One request's tokens [T] over its window's encoder output [S, hidden] -> the
        alignment heads' cross-attention weights [num_heads, T, S]."""
        ...


class SupportsClassify(ModelForward, Protocol):
    """An encoder-only model with a sequence-classification head."""

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, num_labels] float32."""
        ...


def protocol_members(protocol: type) -> list[str]:
    """The public members `protocol` and the protocols it extends declare (methods,
    properties and annotated attributes), sorted; dunders (`__call__`) are left out."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names.update(cls.__dict__.get("__annotations__", {}))
        names.update(n for n, v in cls.__dict__.items() if callable(v) or isinstance(v, property))
    return sorted(n for n in names if not n.startswith("_"))


def require(model: object, protocols: tuple[type, ...], user: str) -> None:
    """TypeError naming every member of `protocols` that `model` lacks; `user` says who
    calls them (for the message).

    Only members are checked (a structural `hasattr`), not signatures; every model is an
    `nn.Module`, so its forward (`model(input_ids, positions, ...)`) is there by construction."""
    missing = sorted(
        {name for p in protocols for name in protocol_members(p) if not hasattr(model, name)}
    )
    if missing:
        names = ", ".join(p.__name__ for p in protocols)
        raise TypeError(
            f"{type(model).__name__} cannot be served by {user}: it lacks {', '.join(missing)} "
            f"(required by {names} in v1/models/interfaces.py)"
        )
