"""T5-family models: T5 v1.0, v1.1 / flan-T5 and mT5 encoder-decoders, and the T5 encoder alone
(sentence-t5 embeddings). Pre-norm blocks with RMS T5LayerNorm, no 1/sqrt(d) scaling, and a
bucketed relative-position bias whose table lives in block 0 of each stack and is shared by
every self-attention layer of that stack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from v1.attention.backend import AttentionType, RelativePositionBias
from v1.attention.cross_attention import EncoderDecoderAttention
from v1.attention.layer import Attention
from v1.models.layers.activation import get_act_fn
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import (
    ColumnLinear,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    default_weight_loader,
)
from v1.models.layers.norm import RMSNorm
from v1.models.utils import load_weights_into, lora_target_of
from v1.quantization.fp8_recipes import decoder_per_token_linears

# Every T5 checkpoint ties both stacks' input embeddings to `shared`.
_EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Cross-attention q/k/v are renamed before packing so that the self-attention mapping of
# q/k/v onto qkv_proj does not catch them (their keys/values come from the encoder).
_CROSS_QKV = re.compile(r"\.EncDecAttention\.([qkv])\.")


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    """Keep float16 activations finite, as transformers' T5Block does (no-op otherwise)."""
    if hidden_states.dtype != torch.float16:
        return hidden_states
    finfo = torch.finfo(torch.float16)
    has_inf = torch.isinf(hidden_states).any()  # no sync: stays on device
    clamp_value = torch.where(has_inf, finfo.max - 1000, finfo.max).to(hidden_states.dtype)
    return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)


def _feed_forward_act(cfg: Any) -> tuple[str, bool]:
    """(activation name, gated?) from `feed_forward_proj` ("relu", "gated-gelu", ...)."""
    act_info = cfg.feed_forward_proj.split("-")
    act = getattr(cfg, "dense_act_fn", None) or act_info[-1]
    if cfg.feed_forward_proj == "gated-gelu":
        act = "gelu_new"  # the tanh approximation, as transformers maps it
    return act, act_info[0] == "gated"


def scales_decoder_output(cfg: Any) -> bool:
    """Whether decoder outputs are multiplied by d_model**-0.5 before the LM head.

    Transformers does it for T5 whose config did not untie the embeddings (v1.0; it records
    that as `scale_decoder_outputs` since it now always ties) and never for mT5."""
    if cfg.model_type == "mt5":
        return False
    scale = getattr(cfg, "scale_decoder_outputs", None)
    return bool(getattr(cfg, "tie_word_embeddings", True) if scale is None else scale)


class T5SelfAttention(nn.Module):
    """Fused q/k/v self-attention; block 0 of a stack also owns the relative-bias table."""

    def __init__(
        self, cfg: Any, attn_type: AttentionType, has_relative_bias: bool, prefix: str
    ) -> None:
        super().__init__()
        num_heads, head_dim = cfg.num_heads, cfg.d_kv
        self.qkv_proj = QKVLinear(cfg.d_model, head_dim, num_heads, num_heads)
        self.o = RowLinear(num_heads * head_dim, cfg.d_model)
        if has_relative_bias:
            # [num_buckets, num_heads]: the layout RelativePositionBias reads; tensor
            # parallelism splits it by heads, as the attention's heads.
            self.relative_attention_bias = VocabEmbedding(
                cfg.relative_attention_num_buckets, num_heads, shard_dim=1
            )
        # T5 folds the scaling into its initialization: no 1/sqrt(d) here.
        self.attn = Attention(
            num_heads, head_dim, 1.0, attn_type=attn_type, prefix=f"{prefix}.attn"
        )

    def forward(self, hidden_states: torch.Tensor, bias: RelativePositionBias) -> torch.Tensor:
        q_size = self.qkv_proj.q_size
        q, k, v = self.qkv_proj(hidden_states).split([q_size, q_size, q_size], dim=-1)
        return self.o(self.attn(q, k, v, bias=bias))  # [T, H*D] -> [T, d_model]


class T5CrossAttention(nn.Module):
    """Decoder queries over the encoder output; K/V are projected only on a request's first
    step (when `encoder_hidden_states` is given) and read from the cross blocks after (or,
    absorbed, every step attends over the cached encoder output through kv_proj). No position
    bias in cross-attention."""

    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        num_heads, head_dim = cfg.num_heads, cfg.d_kv
        inner = num_heads * head_dim
        self.q_proj = ColumnLinear(cfg.d_model, inner)
        self.kv_proj = MergedColumnLinear(cfg.d_model, [inner, inner])
        self.o = RowLinear(inner, cfg.d_model)
        self.attn = EncoderDecoderAttention(num_heads, head_dim, 1.0, prefix=f"{prefix}.attn")

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
    ) -> torch.Tensor:
        q = self.q_proj(hidden_states)  # [T, H*D]
        return self.o(self.attn(q, self.kv_proj, encoder_hidden_states))


class T5DenseActDense(nn.Module):
    """v1.0 feed-forward: wo(act(wi(x)))."""

    def __init__(self, cfg: Any, act: str) -> None:
        super().__init__()
        self.wi = ColumnLinear(cfg.d_model, cfg.d_ff)
        self.wo = RowLinear(cfg.d_ff, cfg.d_model)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5DenseGatedActDense(nn.Module):
    """v1.1 / mT5 feed-forward: wo(act(wi_0(x)) * wi_1(x)), wi_0 and wi_1 fused into `wi`."""

    def __init__(self, cfg: Any, act: str) -> None:
        super().__init__()
        self.wi = MergedColumnLinear(cfg.d_model, [cfg.d_ff, cfg.d_ff])
        self.wo = RowLinear(cfg.d_ff, cfg.d_model)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.wi(x).chunk(2, dim=-1)  # [T, d_ff] each
        return self.wo(self.act(gate) * up)


class T5LayerSelfAttention(nn.Module):
    def __init__(
        self, cfg: Any, attn_type: AttentionType, has_relative_bias: bool, prefix: str
    ) -> None:
        super().__init__()
        self.SelfAttention = T5SelfAttention(
            cfg, attn_type, has_relative_bias, prefix=f"{prefix}.SelfAttention"
        )
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor, bias: RelativePositionBias) -> torch.Tensor:
        return hidden_states + self.SelfAttention(self.layer_norm(hidden_states), bias)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.EncDecAttention = T5CrossAttention(cfg, prefix=f"{prefix}.EncDecAttention")
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
    ) -> torch.Tensor:
        normed = self.layer_norm(hidden_states)
        return hidden_states + self.EncDecAttention(normed, encoder_hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        act, gated = _feed_forward_act(cfg)
        dense_cls = T5DenseGatedActDense if gated else T5DenseActDense
        self.DenseReluDense = dense_cls(cfg, act)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.DenseReluDense(self.layer_norm(hidden_states))


class T5Block(nn.Module):
    """[self-attention, (cross-attention,) feed-forward], named as in the checkpoints."""

    def __init__(
        self, cfg: Any, attn_type: AttentionType, has_relative_bias: bool, prefix: str
    ) -> None:
        super().__init__()
        self.is_decoder = attn_type == AttentionType.DECODER
        layers: list[nn.Module] = [
            T5LayerSelfAttention(cfg, attn_type, has_relative_bias, prefix=f"{prefix}.layer.0")
        ]
        if self.is_decoder:
            layers.append(T5LayerCrossAttention(cfg, prefix=f"{prefix}.layer.1"))
        layers.append(T5LayerFF(cfg))
        self.layer = nn.ModuleList(layers)

    def forward(
        self,
        hidden_states: torch.Tensor,
        bias: RelativePositionBias,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = _clamp_fp16(self.layer[0](hidden_states, bias))
        if self.is_decoder:
            hidden_states = _clamp_fp16(self.layer[1](hidden_states, encoder_hidden_states))
        return _clamp_fp16(self.layer[-1](hidden_states))


class T5Stack(nn.Module):
    """The encoder or the decoder: blocks over already-embedded tokens, then a final norm."""

    def __init__(self, cfg: Any, attn_type: AttentionType, num_layers: int, prefix: str) -> None:
        super().__init__()
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.bidirectional = attn_type != AttentionType.DECODER
        self.block = nn.ModuleList(
            T5Block(cfg, attn_type, has_relative_bias=i == 0, prefix=f"{prefix}.block.{i}")
            for i in range(num_layers)
        )
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def relative_bias(self) -> RelativePositionBias:
        """Block 0's table, shared by every self-attention layer of the stack; each query's
        offsets come from its position in the attention metadata."""
        table = self.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        return RelativePositionBias(
            table=table,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
            bidirectional=self.bidirectional,
        )

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        bias = self.relative_bias()
        for block in self.block:
            hidden_states = block(hidden_states, bias, encoder_hidden_states)
        return self.final_layer_norm(hidden_states)  # [T, d_model]


def _rename_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], held: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map checkpoint names onto ours; `lm_head.weight` is held back (see _load_lm_head)."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            held[name] = tensor
            continue
        if name in _EMBEDDING_ALIASES:
            name = "shared.weight"
        yield _CROSS_QKV.sub(r".EncDecAttention.\1_proj.", name), tensor


class T5ForConditionalGeneration(nn.Module):
    """Serves t5 v1.0 (ReLU, tied head, scaled decoder output), v1.1 / flan-T5 (gated-GELU,
    untied head) and, through the subclass, mT5.

    Encoder-decoder interface used by the runner: `encode` once per encoder input, `forward`
    for decoder tokens (projecting cross K/V where encoder_hidden_states is given)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "q": ("qkv_proj", "q"),
        "k": ("qkv_proj", "k"),
        "v": ("qkv_proj", "v"),
        "k_proj": ("kv_proj", 0),
        "v_proj": ("kv_proj", 1),
        "wi_0": ("wi", 0),
        "wi_1": ("wi", 1),
    }
    # Some old checkpoints carry an unused cross-attention bias table.
    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (
        r"EncDecAttention\.relative_attention_bias\.weight$",
    )
    lora_target_modules: ClassVar[tuple[str, ...]] = (
        "q",
        "k",
        "v",
        "o",
        "wi",
        "wi_0",
        "wi_1",
        "wo",
    )
    """PEFT target names an adapter may use (v1/lora applies them from outside)."""
    lora_encoder_modules: ClassVar[str | None] = r"^encoder\.|\.EncDecAttention\.kv_proj$"
    """Regex of our Linears fed encoder rows (the encoder, the cross K/V projections)."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = self.config = hf_config
        self.shared = VocabEmbedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, AttentionType.ENCODER, cfg.num_layers, prefix="encoder")
        num_decoder_layers = getattr(cfg, "num_decoder_layers", None) or cfg.num_layers
        self.decoder = T5Stack(cfg, AttentionType.DECODER, num_decoder_layers, prefix="decoder")
        # Tied until the checkpoint brings a head of its own (v1.1, mT5).
        self.lm_head = LMHead(cfg.vocab_size, cfg.d_model, tie_to=self.shared)
        self.output_scale = cfg.d_model**-0.5 if scales_decoder_output(cfg) else None

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed encoder inputs [Te] -> encoder output [Te, d_model]. Positions are not
        read: the relative bias takes them from the attention metadata."""
        return self.encoder(self.shared(input_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder tokens [T] -> hidden states [T, d_model]. `encoder_hidden_states`
        [Tw, d_model]: the outputs whose cross K/V this step writes (None: nothing to write)."""
        return self.decoder(self.shared(input_ids), encoder_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, d_model] -> logits [N, vocab] (model dtype; samplers upcast)."""
        if self.output_scale is not None:
            hidden_states = hidden_states * self.output_scale
        return self.lm_head(hidden_states)

    def lora_target(self, module_name: str) -> tuple[str, int | str | None]:
        """A PEFT target module (checkpoint name) -> (our Linear, shard id in it or None)."""
        return lora_target_of(
            module_name,
            self.packed_modules_mapping,
            lambda n: _CROSS_QKV.sub(r".EncDecAttention.\1_proj.", n),
        )

    def default_fp8_ignore(self) -> list[str]:
        """fp8 keeps the decoder's per-token GEMMs in the model dtype, as for BART."""
        return decoder_per_token_linears(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        held: dict[str, torch.Tensor] = {}
        loaded = load_weights_into(
            self,
            _rename_checkpoint(weights, held),
            self.packed_modules_mapping,
            self.ignore_unexpected_patterns,
        )
        return loaded | self._load_lm_head(held.get("lm_head.weight"), loaded)

    def _load_lm_head(self, tensor: torch.Tensor | None, loaded: set[str]) -> set[str]:
        """Keep the head tied when the checkpoint has none or one equal to the embedding
        (transformers drops or repeats tied weights); otherwise untie and load it."""
        shared = self.shared.weight
        if tensor is None:
            return set()
        if "shared.weight" in loaded and torch.equal(
            tensor.to(shared.device, shared.dtype), shared
        ):
            return set()
        self.lm_head.weight = nn.Parameter(torch.empty_like(shared), requires_grad=False)
        self.lm_head.tied = False
        # The embedding's loader: under tensor parallelism it reads this rank's vocab rows.
        loader = getattr(shared, "weight_loader", default_weight_loader)
        loader(self.lm_head.weight, tensor)
        return {"lm_head.weight"}


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    """mT5: T5 v1.1's architecture (gated-GELU, untied head) with a large vocabulary."""


class T5EncoderModel(nn.Module):
    """The T5 encoder as an encoder-only model: bidirectional with the relative bias, no KV
    cache; the runner pools its hidden states (sentence-t5 uses mean pooling)."""

    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (r"^decoder\.", r"^lm_head\.")
    packed_modules_mapping = T5ForConditionalGeneration.packed_modules_mapping

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = self.config = hf_config
        self.shared = VocabEmbedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, AttentionType.ENCODER_ONLY, cfg.num_layers, prefix="encoder")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed inputs [T] -> hidden states [T, d_model]; T5 has no token types."""
        return self.encoder(self.shared(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        held: dict[str, torch.Tensor] = {}  # a full T5 checkpoint's head: not ours
        return load_weights_into(
            self,
            _rename_checkpoint(weights, held),
            self.packed_modules_mapping,
            self.ignore_unexpected_patterns,
        )
