"""BART, mBART and Marian: one encoder-decoder transformer with three flavours.

BART: post-norm layers, learned positions offset by 2, a LayerNorm on the embeddings. mBART: the
same with pre-norm layers and a final LayerNorm after each stack. Marian: post-norm, fixed
sinusoidal positions, no embedding LayerNorm, and (optionally) its own decoder vocabulary.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from v1.attention.backend import AttentionType
from v1.models.layers.activation import fuses_input_gelu, gelu_mlp, get_act_fn
from v1.models.layers.attention import CrossAttention, SelfAttention
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.linear import ColumnLinear, RowLinear
from v1.models.layers.norm import LayerNorm, add_layer_norm, fp16_clamp_limit, linear_input
from v1.models.utils import load_weights_into, lora_target_of
from v1.quantization.fp8 import is_fp8_linear
from v1.quantization.fp8_recipes import decoder_per_token_linears
from v1.quantization.fp8_rows import Fp8Product

# Checkpoint projections are renamed onto fused parameters before the packed mapping applies:
# the same names (q_proj, k_proj, v_proj) go to different fused layers in self- and
# cross-attention, and `packed_modules_mapping` keys on one name component only.
_SELF_QKV = re.compile(r"\.self_attn\.([qkv])_proj\.")
_CROSS_KV = re.compile(r"\.encoder_attn\.([kv])_proj\.")
_LEARNED_POS_OFFSET = 2
"""BART and mBART learned position i sits in row i + 2 (fairseq's padding offset)."""


def _rename_projections(name: str) -> str:
    """Checkpoint q/k/v projection names -> the names `packed_modules_mapping` fuses."""
    name = _SELF_QKV.sub(r".self_attn.qkv_\1.", name)
    return _CROSS_KV.sub(r".encoder_attn.kv_\1.", name)


@dataclass(frozen=True)
class BartVariant:
    """How the three flavours differ."""

    pre_norm: bool
    """LayerNorm before each sub-block (mBART) instead of after the residual add."""
    learned_positions: bool
    """Learned positions with the +2 offset (BART, mBART); else sinusoidal (Marian)."""
    layernorm_embedding: bool
    """LayerNorm on token + position embeddings (BART, mBART)."""
    final_layer_norm: bool
    """LayerNorm after the last layer of each stack (mBART)."""


BART = BartVariant(
    pre_norm=False, learned_positions=True, layernorm_embedding=True, final_layer_norm=False
)
MBART = BartVariant(
    pre_norm=True, learned_positions=True, layernorm_embedding=True, final_layer_norm=True
)
MARIAN = BartVariant(
    pre_norm=False, learned_positions=False, layernorm_embedding=False, final_layer_norm=False
)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """transformers' MarianSinusoidalPositionalEmbedding weight [num_positions, dim] in float32:
    sin features in the first half, cos in the second (not interleaved), computed in float64
    with numpy exactly as there."""
    j = np.arange(dim)
    position_enc = np.arange(num_positions)[:, None] / np.power(10000, 2 * (j // 2) / dim)[None, :]
    out = np.empty((num_positions, dim), dtype=np.float32)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, :sentinel] = np.sin(position_enc[:, 0::2])
    out[:, sentinel:] = np.cos(position_enc[:, 1::2])
    return torch.from_numpy(out)


def _post_norm(norm: LayerNorm, hidden_states: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Post-norm residual sub-block: norm(x + f(x)), given f(x) (one fused kernel on CUDA)."""
    return add_layer_norm(out, hidden_states, norm, store_residual=False)[0]


def _pre_norm_input(
    norm: LayerNorm,
    hidden_states: Any,
    residual: torch.Tensor | None,
    clamp: float | None = None,
    residual_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's first sub-block input and its residual stream, from the carried pair
    (residual None: `hidden_states` is the whole input; else the input is residual +
    hidden_states, clamped to +-clamp like an fp16 encoder layer's output). The residual
    stream returned carries `residual_bias` (see `add_layer_norm`)."""
    if residual is None:
        residual = hidden_states if residual_bias is None else hidden_states + residual_bias
        return linear_input(norm, norm(hidden_states)), residual
    normed, residual = add_layer_norm(
        hidden_states, residual, norm, clamp=clamp, residual_bias=residual_bias
    )
    assert residual is not None
    return normed, residual


def _deferred_bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias an `unscaled_output` fp8 Linear leaves to its owner (None otherwise)."""
    return layer.bias if layer.unscaled_output else None


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers clamps fp16 encoder outputs to avoid inf (BART/Marian only once non-finite:
    # we clamp always, which differs only for finite values within 1000 of the fp16 max, and
    # needs no host sync).
    limit = fp16_clamp_limit(hidden_states.dtype)
    return hidden_states if limit is None else hidden_states.clamp(-limit, limit)


BART_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
"""The PEFT target names of BART-layout layers (BART, mBART, Marian, Whisper)."""
BART_LORA_ENCODER_MODULES = r"^model\.encoder\.|\.encoder_attn\.kv_proj$"
"""Their Linears fed encoder rows: the encoder and the cross-attention K/V projections."""


class LearnedPositions(VocabEmbedding):
    """BART/mBART learned positions: position i reads row i + 2 (fairseq's padding offset)."""

    def __init__(self, num_positions: int, embedding_dim: int) -> None:
        super().__init__(num_positions + _LEARNED_POS_OFFSET, embedding_dim, shard_dim=None)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + _LEARNED_POS_OFFSET)


class SinusoidalPositions(nn.Module):
    """Marian's fixed table (not in checkpoints): positions [T] -> [T, dim]."""

    def __init__(self, num_positions: int, embedding_dim: int) -> None:
        super().__init__()
        table = sinusoidal_table(num_positions, embedding_dim)
        device = torch.empty(0).device  # the loader's device context, if any
        table = table.to(device=device, dtype=torch.get_default_dtype())
        self.register_buffer("weight", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight[positions]


class BartEncoderLayer(nn.Module):
    """forward(hidden_states, residual) -> (hidden_states, residual).

    Post-norm layers take and return residual None. Pre-norm layers carry their input as the
    residual stream plus the last sub-block's output (vLLM's convention), so each residual add
    runs fused with the LayerNorm after it (`add_layer_norm`); the stack adds the last pair in
    its final norm. The fp16 clamp of an encoder layer's output is applied where that pair is
    added (the next layer, or the stack's end)."""

    def __init__(self, cfg: Any, variant: BartVariant, prefix: str) -> None:
        super().__init__()
        d_model = cfg.d_model
        self.pre_norm = variant.pre_norm
        self.self_attn = SelfAttention(
            d_model, cfg.encoder_attention_heads, AttentionType.ENCODER, f"{prefix}.self_attn"
        )
        self.self_attn_layer_norm = LayerNorm(d_model)
        self.fc1 = ColumnLinear(d_model, cfg.encoder_ffn_dim, bias=True)
        self.fc2 = RowLinear(cfg.encoder_ffn_dim, d_model, bias=True)
        self.act = get_act_fn(cfg.activation_function)
        self.final_layer_norm = LayerNorm(d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(self.fc1, self.act, self.fc2, x)  # [T, d] -> [T, ffn] -> [T, d]

    def link_fp8_norms(self) -> None:
        """After fp8 quantization, for a pre-norm layer:
        - its norms feed one Linear each (qkv_proj, fc1); when it is fp8 the norm hands its
          output over quantized, from its own kernel (on an H100, 48,000 x 1280 Whisper rows:
          a 76 us quantizer pass saved per norm);
        - out_proj, fc1 and fc2, where fp8 on a GPU, hand their outputs over unscaled and
          without their bias (`Fp8Product`): the add + LayerNorm after out_proj and the next
          layer's (or the stack's) after fc2 scale them; fc2's input quantizer scales fc1's
          and adds its bias; out_proj's and fc2's biases ride in the residual stream, added by
          the add + LayerNorm before each (`residual_bias`)."""
        if not self.pre_norm:
            return
        self.self_attn_layer_norm.fp8_output = is_fp8_linear(self.self_attn.qkv_proj)
        self.final_layer_norm.fp8_output = is_fp8_linear(self.fc1)
        dtype = self.final_layer_norm.weight.dtype
        out_proj = self.self_attn.out_proj
        if is_fp8_linear(out_proj):
            out_proj.quant_method.set_unscaled_output(out_proj, dtype)
        if is_fp8_linear(self.fc2):
            self.fc2.quant_method.set_unscaled_output(self.fc2, dtype)
            if is_fp8_linear(self.fc1) and fuses_input_gelu(self.fc2, self.act):
                self.fc1.quant_method.set_unscaled_output(self.fc1, dtype)

    def forward(
        self, hidden_states: Any, residual: torch.Tensor | None = None
    ) -> tuple[Any, torch.Tensor | None]:
        """hidden_states (in and out) may be an fp8 fc2's `Fp8Product` (`link_fp8_norms`)."""
        if not self.pre_norm:
            hidden_states = _post_norm(
                self.self_attn_layer_norm, hidden_states, self.self_attn(hidden_states)
            )
            hidden_states = _post_norm(
                self.final_layer_norm, hidden_states, self.mlp(hidden_states)
            )
            return _clamp_fp16(hidden_states), None
        clamp = fp16_clamp_limit(hidden_states.dtype)
        normed, residual = _pre_norm_input(
            self.self_attn_layer_norm,
            hidden_states,
            residual,
            clamp,
            _deferred_bias(self.self_attn.out_proj),
        )
        normed, residual = add_layer_norm(
            self.self_attn(normed),
            residual,
            self.final_layer_norm,
            residual_bias=_deferred_bias(self.fc2),
        )
        return self.mlp(normed), residual


class BartDecoderLayer(nn.Module):
    """forward(hidden_states, encoder_hidden_states, residual) -> (hidden_states, residual),
    carried as in `BartEncoderLayer` (no clamp: transformers clamps encoder layers only)."""

    def __init__(self, cfg: Any, variant: BartVariant, prefix: str) -> None:
        super().__init__()
        d_model, num_heads = cfg.d_model, cfg.decoder_attention_heads
        self.pre_norm = variant.pre_norm
        self.self_attn = SelfAttention(
            d_model, num_heads, AttentionType.DECODER, f"{prefix}.self_attn"
        )
        self.self_attn_layer_norm = LayerNorm(d_model)
        self.encoder_attn = CrossAttention(d_model, num_heads, f"{prefix}.encoder_attn")
        self.encoder_attn_layer_norm = LayerNorm(d_model)
        self.fc1 = ColumnLinear(d_model, cfg.decoder_ffn_dim, bias=True)
        self.fc2 = RowLinear(cfg.decoder_ffn_dim, d_model, bias=True)
        self.act = get_act_fn(cfg.activation_function)
        self.final_layer_norm = LayerNorm(d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(self.fc1, self.act, self.fc2, x)  # [T, d] -> [T, ffn] -> [T, d]

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.pre_norm:
            hidden_states = _post_norm(
                self.self_attn_layer_norm, hidden_states, self.self_attn(hidden_states)
            )
            hidden_states = _post_norm(
                self.encoder_attn_layer_norm,
                hidden_states,
                self.encoder_attn(hidden_states, encoder_hidden_states),
            )
            hidden_states = _post_norm(
                self.final_layer_norm, hidden_states, self.mlp(hidden_states)
            )
            return hidden_states, None
        normed, residual = _pre_norm_input(self.self_attn_layer_norm, hidden_states, residual)
        normed, residual = add_layer_norm(
            self.self_attn(normed), residual, self.encoder_attn_layer_norm
        )
        normed, residual = add_layer_norm(
            self.encoder_attn(normed, encoder_hidden_states), residual, self.final_layer_norm
        )
        return self.mlp(normed), residual


def finish_stack(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    norm: LayerNorm | None,
    clamp: float | None = None,
) -> torch.Tensor:
    """The last layer's carried pair -> the stack's output: norm(residual + hidden_states)
    (clamped first when `clamp`), or the plain sum without a final norm; post-norm stacks
    (residual None) only apply the norm."""
    if residual is None:
        return norm(hidden_states) if norm is not None else hidden_states
    if norm is not None:
        return add_layer_norm(hidden_states, residual, norm, store_residual=False, clamp=clamp)[0]
    if isinstance(hidden_states, Fp8Product):
        hidden_states = hidden_states.dequantize()
    hidden_states = hidden_states + residual
    return hidden_states if clamp is None else hidden_states.clamp(-clamp, clamp)


class BartStack(nn.Module):
    """What the encoder and decoder share: embeddings in, optional final LayerNorm out."""

    def __init__(self, cfg: Any, variant: BartVariant, embed_tokens: VocabEmbedding) -> None:
        super().__init__()
        d_model = cfg.d_model
        self.embed_scale = math.sqrt(d_model) if cfg.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        positions_cls = LearnedPositions if variant.learned_positions else SinusoidalPositions
        self.embed_positions = positions_cls(cfg.max_position_embeddings, d_model)
        self.layernorm_embedding = LayerNorm(d_model) if variant.layernorm_embedding else None
        self.layer_norm = LayerNorm(d_model) if variant.final_layer_norm else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [T] -> scaled token embeddings + positions (+ LayerNorm) [T, d_model]."""
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        hidden_states = hidden_states + self.embed_positions(positions)
        if self.layernorm_embedding is not None:
            hidden_states = self.layernorm_embedding(hidden_states)
        return hidden_states


class BartEncoder(BartStack):
    def __init__(
        self, cfg: Any, variant: BartVariant, embed_tokens: VocabEmbedding, prefix: str
    ) -> None:
        super().__init__(cfg, variant, embed_tokens)
        self.layers = nn.ModuleList(
            BartEncoderLayer(cfg, variant, f"{prefix}.layers.{i}")
            for i in range(cfg.encoder_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed(input_ids, positions)  # [Te, d_model]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        clamp = fp16_clamp_limit(hidden_states.dtype)
        return finish_stack(hidden_states, residual, self.layer_norm, clamp)


class BartDecoder(BartStack):
    def __init__(
        self, cfg: Any, variant: BartVariant, embed_tokens: VocabEmbedding, prefix: str
    ) -> None:
        super().__init__(cfg, variant, embed_tokens)
        self.layers = nn.ModuleList(
            BartDecoderLayer(cfg, variant, f"{prefix}.layers.{i}")
            for i in range(cfg.decoder_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden_states = self.embed(input_ids, positions)  # [T, d_model]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, encoder_hidden_states, residual)
        return finish_stack(hidden_states, residual, self.layer_norm)


class BartModel(nn.Module):
    """The two stacks and their token embeddings, tied as transformers 5 ties them: with
    tie_word_embeddings, `shared` is the encoder's, the decoder's and the LM head's weight
    (Marian with share_encoder_decoder_embeddings=False: the decoder's and the head's only);
    without it every embedding is separate."""

    def __init__(self, cfg: Any, variant: BartVariant, prefix: str) -> None:
        super().__init__()
        d_model = cfg.d_model
        tied = bool(getattr(cfg, "tie_word_embeddings", True))
        share = bool(getattr(cfg, "share_encoder_decoder_embeddings", True))
        decoder_vocab_size = cfg.vocab_size if share else cfg.decoder_vocab_size
        if tied and share:
            self.shared = VocabEmbedding(cfg.vocab_size, d_model)  # registered first: canonical
            encoder_embed = decoder_embed = self.shared
        else:
            encoder_embed = VocabEmbedding(cfg.vocab_size, d_model)
            decoder_embed = VocabEmbedding(decoder_vocab_size, d_model)
        self.tie_lm_head = tied
        self.encoder = BartEncoder(cfg, variant, encoder_embed, f"{prefix}.encoder")
        self.decoder = BartDecoder(cfg, variant, decoder_embed, f"{prefix}.decoder")


class BartForConditionalGeneration(nn.Module):
    """Serves BartForConditionalGeneration checkpoints; mBART and Marian differ in `variant`."""

    variant: ClassVar[BartVariant] = BART
    # Checkpoint names as renamed by `_hf_to_local` (_SELF_QKV, _CROSS_KV) -> fused parameters.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "qkv_q": ("qkv_proj", "q"),
        "qkv_k": ("qkv_proj", "k"),
        "qkv_v": ("qkv_proj", "v"),
        "kv_k": ("kv_proj", 0),
        "kv_v": ("kv_proj", 1),
    }
    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (
        r"^model\.(encoder|decoder)\.version$",  # fairseq leftovers in old checkpoints
        r"^model\.shared\.weight$",  # present in untied checkpoints too; read in load_weights
    )
    lora_target_modules: ClassVar[tuple[str, ...]] = BART_LORA_TARGETS
    """PEFT target names an adapter may use (v1/lora applies them from outside)."""
    lora_encoder_modules: ClassVar[str | None] = BART_LORA_ENCODER_MODULES
    """Regex of our Linears fed encoder rows (the encoder, the cross K/V projections)."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = BartModel(hf_config, self.variant, model_prefix)
        decoder_embed = self.model.decoder.embed_tokens
        self.lm_head = LMHead(
            decoder_embed.num_embeddings,
            hf_config.d_model,
            bias=True,  # the checkpoint's final_logits_bias
            tie_to=decoder_embed if self.model.tie_lm_head else None,
        )
        # Checkpoint names of tied weights -> the one local name they load into.
        first: dict[int, str] = {}
        self.tied_aliases: dict[str, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            canonical = first.setdefault(id(param), name)
            if canonical != name:
                self.tied_aliases[name] = canonical

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed encoder tokens [Te] of several requests (positions restart at 0 for each)
        -> encoder output [Te, d_model]."""
        return self.model.encoder(input_ids, positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder tokens [T] of the whole batch -> hidden states [T, d_model].

        encoder_hidden_states [Tw, d_model]: the encoder outputs of the requests on their first
        step (in the runner's `encoder_reqs` order), projected into their cross blocks; None
        when no request starts this step (cross-attention only reads)."""
        return self.model.decoder(input_ids, positions, encoder_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, d_model] -> logits [N, decoder vocab] (+ final_logits_bias), in the
        model dtype (samplers upcast)."""
        return self.lm_head(hidden_states)

    def _hf_to_local(
        self, weights: Iterable[tuple[str, torch.Tensor]], untied_shared: list[torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name == "final_logits_bias":
                name, tensor = "lm_head.bias", tensor.reshape(-1)  # [1, V] -> [V]
            elif name == "model.shared.weight" and name not in params:
                untied_shared.append(tensor)
            name = _rename_projections(self.tied_aliases.get(name, name))
            yield name, tensor

    def lora_target(self, module_name: str) -> tuple[str, int | str | None]:
        """A PEFT target module (checkpoint name) -> (our Linear, shard id in it or None)."""
        return lora_target_of(module_name, self.packed_modules_mapping, _rename_projections)

    def default_fp8_ignore(self) -> list[str]:
        """fp8 keeps the decoder's per-token GEMMs in the model dtype (slower in fp8 at decode
        batch sizes); the encoder and the cross-attention K/V projections are fp8."""
        return decoder_per_token_linears(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        untied_shared: list[torch.Tensor] = []
        loaded = load_weights_into(
            self,
            self._hf_to_local(weights, untied_shared),
            self.packed_modules_mapping,
            self.ignore_unexpected_patterns,
        )
        params = dict(self.named_parameters())
        # Untied checkpoints from older tools may keep only `shared` for the stacks' embeddings.
        for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            param = params.get(name)
            if param is not None and name not in loaded and untied_shared:
                param.weight_loader(param, untied_shared[-1])
                loaded.add(name)
        # Checkpoints may omit final_logits_bias (transformers then keeps zeros).
        if "lm_head.bias" not in loaded:
            with torch.no_grad():
                self.lm_head.bias.zero_()
            loaded.add("lm_head.bias")
        return loaded


class MBartForConditionalGeneration(BartForConditionalGeneration):
    """mBART: pre-norm layers and a final LayerNorm per stack. Target-language codes come from
    the generation config's forced_bos_token_id (applied by the frontend)."""

    variant = MBART


class MarianMTModel(BartForConditionalGeneration):
    """Marian (opus-mt): sinusoidal positions, scaled embeddings, a decoder vocabulary of
    `decoder_vocab_size` when the encoder and decoder do not share embeddings."""

    variant = MARIAN
    ignore_unexpected_patterns = (
        *BartForConditionalGeneration.ignore_unexpected_patterns,
        r"^model\.(encoder|decoder)\.embed_positions\.weight$",  # the fixed sinusoidal table
    )
