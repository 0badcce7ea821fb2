"""Llama-family decoder-only LMs: Llama (1-3.x), Mistral and Qwen2 share this file.
Pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP, RMSNorm throughout.
Must hold: sliding windows are not applied, so ModelConfig caps max_model_len at the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from v1.attention.layer import Attention
from v1.models.layers.activation import SiluAndMul
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from v1.models.layers.norm import RMSNorm
from v1.models.layers.rotary import get_rope
from v1.models.utils import load_weights_into, lora_target_of


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(cfg)
        attention_bias = getattr(cfg, "attention_bias", False)
        qkv_bias = attention_bias or cfg.model_type == "qwen2"
        self.qkv_proj = QKVLinear(
            cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowLinear(
            self.num_heads * self.head_dim, cfg.hidden_size, bias=attention_bias
        )
        self.rotary_emb = get_rope(cfg, self.head_dim)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, H*D] -> [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act='silu' only, got {cfg.hidden_act!r}")
        bias = getattr(cfg, "mlp_bias", False)
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [size, size], bias=bias)
        self.down_proj = RowLinear(size, cfg.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            self.act_fn(self.gate_up_proj(x))
        )  # [T, 2*I] -> [T, I] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's output, the residual stream before it): their sum is the
        block's result, added lazily by the next norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, prefix=f"{prefix}.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints.

    Qwen2 adds a bias to q/k/v; Llama's `attention_bias`/`mlp_bias` add them everywhere. q/k/v
    and gate/up are fused at load time (`packed_modules_mapping`). Sliding windows (Mistral,
    Qwen2) are not applied: ModelConfig caps max_model_len at the window, inside which full
    attention is the same."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    lora_target_modules: ClassVar[tuple[str, ...]] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """PEFT target names an adapter may use (v1/lora applies them from outside)."""
    lora_encoder_modules: ClassVar[str | None] = None
    """Regex of our Linears fed encoder rows (none: decoder-only)."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = LlamaModel(hf_config, prefix=model_prefix)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 (all requests packed) -> hidden_states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] (model dtype; samplers upcast)."""
        return self.lm_head(hidden_states)

    def lora_target(self, module_name: str) -> tuple[str, int | str | None]:
        """A PEFT target module (checkpoint name) -> (our Linear, shard id in it or None)."""
        return lora_target_of(module_name, self.packed_modules_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = self.ignore_unexpected_patterns
        if self.tie_word_embeddings:  # some tied checkpoints still store the head
            ignore = (*ignore, r"^lm_head\.weight$")
        return load_weights_into(self, weights, self.packed_modules_mapping, ignore)
