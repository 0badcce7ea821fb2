"""GPT-2: learned absolute positions, pre-LayerNorm blocks, fused c_attn, gelu_new MLP, and an
LM head tied to the token embedding. Checkpoints store Conv1D weights as [in, out]; they are
transposed at load into ordinary [out, in] linears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from v1.attention.layer import Attention
from v1.models.layers.activation import get_act_fn
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import ColumnLinear, MergedColumnLinear, RowLinear
from v1.models.layers.norm import LayerNorm
from v1.models.utils import load_weights_into

_CONV1D_WEIGHT = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        # rows [q | k | v]: fused in the checkpoint, split by parts under tensor parallelism
        self.c_attn = MergedColumnLinear(hidden, [hidden, hidden, hidden], bias=True)
        self.c_proj = RowLinear(hidden, hidden, bias=True)
        self.attn = Attention(self.num_heads, self.head_dim, scale, prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)  # 3 x [T, hidden]
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.hidden_size
        self.c_fc = ColumnLinear(cfg.hidden_size, inner, bias=True)
        self.c_proj = RowLinear(inner, cfg.hidden_size, bias=True)
        self.act = get_act_fn(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx, prefix=f"{prefix}.attn")
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any, prefix: str = "transformer") -> None:
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size, shard_dim=None)
        self.h = nn.ModuleList(
            GPT2Block(cfg, i, prefix=f"{prefix}.h.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [T, hidden]
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    # The causal-mask buffers old checkpoints carry.
    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (r"\.attn\.(masked_)?bias$",)

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not supported")
        self.config = hf_config
        self.transformer = GPT2Model(
            hf_config, prefix=f"{prefix}.transformer" if prefix else "transformer"
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = LMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            tie_to=self.transformer.wte if self.tie_word_embeddings else None,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 (all requests packed) -> hidden_states [T, hidden]."""
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] (model dtype; samplers upcast)."""
        return self.lm_head(hidden_states)

    @staticmethod
    def _hf_to_local(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            # The original OpenAI-converted checkpoints omit the "transformer." prefix.
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"
            if _CONV1D_WEIGHT.search(name):
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = self.ignore_unexpected_patterns
        if self.tie_word_embeddings:
            ignore = (*ignore, r"^lm_head\.weight$")
        return load_weights_into(self, self._hf_to_local(weights), None, ignore)
