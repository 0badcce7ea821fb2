"""Token embedding and the LM head; the head can share the embedding's weight (tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from v1.models.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """weight [num_embeddings, embedding_dim]; vocab rows would be sharded under TP."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in float32. `tie_to` shares an embedding weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        bias: bool = False,
        tie_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        if tie_to is not None:
            if tie_to.weight.shape != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie an LM head [{vocab_size}, {hidden_size}] to an embedding "
                    f"{tuple(tie_to.weight.shape)}"
                )
            self.weight = tie_to.weight  # the same Parameter: loaded once, listed once
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(vocab_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight, self.bias).float()

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
