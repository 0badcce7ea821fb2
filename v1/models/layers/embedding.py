"""Token embedding and the LM head; the head can share the embedding's weight (tied).

Under tensor parallelism (v1/distributed/tensor_parallel.py sets `tp`) a token embedding holds
its rank's rows of the vocabulary (padded to equal parts): a lookup zeroes the ids outside them
and sums over the ranks; the LM head computes its rows' logits and gathers the full vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from v1.models.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """weight [num_embeddings, embedding_dim]. `shard_dim` says how tensor parallelism splits
    it: 0 vocabulary rows (token embeddings), 1 columns (T5's relative-bias table, [buckets,
    heads]: split by heads), None replicated (position and token-type tables)."""

    tp: Any = None
    """The TensorParallelGroup once sharded."""
    vocab_start: int = 0
    """First vocabulary row this rank holds (sharded by rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, shard_dim: int | None = 0) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_dim = shard_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.shard_dim != 0:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] in the weights' dtype. `tie_to` shares an
    embedding weight."""

    tp: Any = None
    """The TensorParallelGroup once sharded (rows of the vocabulary per rank)."""

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
        self._padded: tuple[torch.Tensor, torch.Tensor | None] | None = None
        """(weight, bias) with the vocabulary padded (`pad_vocab_`); the parameters view them."""

    def pad_vocab_(self, multiple: int = 64) -> bool:
        """Move the loaded weight (and bias) into storage padded to a multiple of `multiple`
        vocabulary rows; the parameters (and a tied embedding, which shares the Parameter)
        become views of its first rows. A GEMM whose output rows are not 16-byte aligned
        (BART's 50,265 or Whisper's 51,866 logits in 16 bits) takes a slow cuBLAS kernel:
        BART-large's head took 276 us a step on an H100 (6% of its decode). Returns whether
        it padded."""
        rows = self.weight.shape[0]
        if self.tp is not None or rows % multiple == 0 or self._padded is not None:
            return False
        padded_rows = -(-rows // multiple) * multiple
        weight = self.weight.new_zeros(padded_rows, self.weight.shape[1])
        weight[:rows] = self.weight.data
        self.weight.data = weight[:rows]
        bias = None
        if self.bias is not None:
            bias = self.bias.new_zeros(padded_rows)
            bias[:rows] = self.bias.data
            self.bias.data = bias[:rows]
        self._padded = (weight, bias)
        return True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the weights' dtype, unit stride along the vocabulary (with a
        padded vocabulary, a view of the padded GEMM output). Not upcast here: the samplers
        copy what they process to float32 themselves, and the fused greedy kernel reads 16-bit
        logits directly (a float32 copy of Whisper's [256, 51866] logits took 51 us a decode
        step on an H100, and doubled the bytes the sampler reads)."""
        if self._padded is not None:
            weight, bias = self._padded
            return F.linear(hidden_states, weight, bias)[:, : self.weight.shape[0]]
        logits = F.linear(hidden_states, self.weight, self.bias)  # [N, vocab rows held]
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[:, : self.vocab_size]  # drop the padding rows
        return logits

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
