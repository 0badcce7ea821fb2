"""Whisper: log-mel features computed on device, a conv front end and pre-norm encoder, and a
pre-norm decoder with paged self-attention and cross-attention written once per request.

Serves multilingual, `.en` and 128-mel (large-v3) checkpoints. The special token ids and the
alignment heads come from the generation config, read once per process by `v1.model_info`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from v1.audio.features import LogMelSpectrogram
from v1.models.bart import (
    BART_LORA_ENCODER_MODULES,
    BART_LORA_TARGETS,
    MBART,
    BartDecoderLayer,
    BartEncoderLayer,
    finish_stack,
)
from v1.models.layers.embedding import LMHead, VocabEmbedding
from v1.models.layers.norm import LayerNorm, fp16_clamp_limit
from v1.models.utils import load_weights_into, lora_target_of

# Checkpoint projections are renamed onto fused parameters (as in bart.py): q/k/v of the
# self-attentions and k/v of the cross-attentions share names that `packed_modules_mapping`
# (one name component) cannot tell apart.
_SELF_QKV = re.compile(r"\.self_attn\.([qkv])_proj\.")
_CROSS_KV = re.compile(r"\.encoder_attn\.([kv])_proj\.")
# Whisper's k projections have no bias; the fused layers hold a zero bias for their k rows.
_K_WEIGHT = re.compile(r"\.(self_attn\.qkv|encoder_attn\.kv)_k\.weight$")


def _rename_projections(name: str) -> str:
    """Checkpoint q/k/v projection names -> the names `packed_modules_mapping` fuses."""
    name = _SELF_QKV.sub(r".self_attn.qkv_\1.", name)
    return _CROSS_KV.sub(r".encoder_attn.kv_\1.", name)


class WhisperEncoder(nn.Module):
    """log-mel [B, n_mels, 2 * max_source_positions] -> packed states [B * max_source_positions,
    d_model]: two convolutions (the second halves the frames), learned positions, pre-norm
    layers, a final LayerNorm."""

    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        d_model = cfg.d_model
        self.num_positions = cfg.max_source_positions
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.conv1.requires_grad_(False)
        self.conv2.requires_grad_(False)
        self.embed_positions = VocabEmbedding(cfg.max_source_positions, d_model, shard_dim=None)
        self.layers = nn.ModuleList(
            BartEncoderLayer(cfg, MBART, f"{prefix}.layers.{i}") for i in range(cfg.encoder_layers)
        )
        self.layer_norm = LayerNorm(d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        features = features.to(self.conv1.weight.dtype)
        hidden_states = F.gelu(self.conv1(features))  # [B, d, 2P]
        hidden_states = F.gelu(self.conv2(hidden_states))  # [B, d, P]
        if hidden_states.shape[-1] != self.num_positions:
            raise ValueError(
                f"the encoder expects {2 * self.num_positions} mel frames, got {features.shape[-1]}"
            )
        hidden_states = hidden_states.transpose(1, 2) + self.embed_positions.weight  # [B, P, d]
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])  # [B * P, d]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        clamp = fp16_clamp_limit(hidden_states.dtype)
        return finish_stack(hidden_states, residual, self.layer_norm, clamp)


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        d_model = cfg.d_model
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, d_model)
        self.embed_positions = VocabEmbedding(cfg.max_target_positions, d_model, shard_dim=None)
        self.layers = nn.ModuleList(
            BartDecoderLayer(cfg, MBART, f"{prefix}.layers.{i}") for i in range(cfg.decoder_layers)
        )
        self.layer_norm = LayerNorm(d_model)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
    ) -> torch.Tensor:
        # transformers defines embed_scale for Whisper but never applies it.
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(positions)  # [T, d]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, encoder_hidden_states, residual)
        return finish_stack(hidden_states, residual, self.layer_norm)


class WhisperModel(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(cfg, f"{prefix}.encoder")
        self.decoder = WhisperDecoder(cfg, f"{prefix}.decoder")


class WhisperForConditionalGeneration(nn.Module):
    """Serves WhisperForConditionalGeneration checkpoints (the LM head is tied to the decoder's
    token embedding, as in every Whisper checkpoint)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "qkv_q": ("qkv_proj", "q"),
        "qkv_k": ("qkv_proj", "k"),
        "qkv_v": ("qkv_proj", "v"),
        "kv_k": ("kv_proj", 0),
        "kv_v": ("kv_proj", 1),
    }
    # Some conversions store the tied head; it is the decoder's embedding either way.
    ignore_unexpected_patterns: ClassVar[tuple[str, ...]] = (r"^proj_out\.weight$",)
    lora_target_modules: ClassVar[tuple[str, ...]] = BART_LORA_TARGETS
    """PEFT target names an adapter may use (v1/lora applies them from outside)."""
    lora_encoder_modules: ClassVar[str | None] = BART_LORA_ENCODER_MODULES
    """Regex of our Linears fed encoder rows (the encoder, the cross K/V projections)."""
    fp8_keep: ClassVar[tuple[str, ...]] = (
        "model.encoder.layers.0",
        "model.encoder.layers.1",
        r"re:model\.encoder\.layers\.\d+\.fc2",
        r"re:model\.decoder\.layers\.\d+\.(self_attn\.\w+|encoder_attn\.(q_proj|out_proj)|fc1|fc2)",
    )
    """Linears quantization="fp8" keeps in the model dtype: encoder layers 0 and 1 (layer 0's
    attention alone moves the output more than layers 1-5 together), every encoder layer's fc2
    (real whisper-base on real speech: 1.03% -> 0.63% WER against fp16's 0.20%) and the
    decoder's per-token GEMMs; the rest of encoder layers 2+ and the cross K/V projections of
    the encoder states (the compute-bound GEMMs) are fp8 (docs/decisions.md, "fp8")."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = WhisperModel(hf_config, model_prefix)
        self.proj_out = LMHead(
            hf_config.vocab_size, hf_config.d_model, tie_to=self.model.decoder.embed_tokens
        )
        # Features stay float32 whatever the model dtype (the loader's default dtype would
        # otherwise make the Hann window and filters 16-bit on GPU).
        self.mel = _make_log_mel(hf_config).float()
        if self.mel.n_mels != hf_config.num_mel_bins:
            raise ValueError(
                f"the feature extractor makes {self.mel.n_mels} mel bins, the model expects "
                f"{hf_config.num_mel_bins}"
            )

    # ---- steps ----
    def encode(self, audio: list[torch.Tensor]) -> torch.Tensor:
        """1-D float32 16 kHz waveforms of at most one window each -> packed encoder states
        [len(audio) * max_source_positions, d_model] (log-mel features computed on device)."""
        features = self.mel(audio)  # [B, n_mels, 3000] float32
        return self.model.encoder(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder tokens [T] of the whole batch -> hidden states [T, d_model].

        encoder_hidden_states [Tw, d_model]: the encoder outputs of the requests on their first
        step (the runner's `encoder_reqs` order), projected into their cross blocks; None when
        no request starts this step (cross-attention only reads)."""
        return self.model.decoder(input_ids, positions, encoder_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, d_model] -> logits [N, vocab] (model dtype; samplers upcast)."""
        return self.proj_out(hidden_states)

    # ---- word timestamps ----
    @torch.inference_mode()
    def alignment_attention(
        self,
        token_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        heads: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """A teacher-forced decoder pass over `token_ids` [T] (one request, no KV cache) with
        the window's encoder output [S, d_model] -> the cross-attention weights
        softmax(q k^T / sqrt(head_dim)) of the alignment `heads` ([decoder layer, head] pairs,
        `ModelInfo.alignment_heads`) [num_heads, T, S] float32.

        Plain torch, eager: it runs outside the step's attention backends and CUDA graphs, and
        only through the last layer that holds an alignment head."""
        pairs = [(int(layer), int(head)) for layer, head in heads]
        if not pairs:
            raise ValueError("this Whisper checkpoint has no alignment_heads in its config")
        cfg = self.config
        for layer, head in pairs:
            if not (0 <= layer < cfg.decoder_layers and 0 <= head < cfg.decoder_attention_heads):
                raise ValueError(f"alignment head {(layer, head)} is outside the decoder")
        decoder = self.model.decoder
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden_states = decoder.embed_tokens(token_ids) + decoder.embed_positions(positions)
        weights: dict[tuple[int, int], torch.Tensor] = {}
        for index in range(max(layer for layer, _ in pairs) + 1):
            hidden_states, probs = _eager_decoder_layer(
                decoder.layers[index], hidden_states, encoder_hidden_states
            )
            for layer, head in pairs:
                if layer == index:
                    weights[(layer, head)] = probs[head]
        return torch.stack([weights[pair] for pair in pairs])

    # ---- weights ----
    def _hf_to_local(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = _rename_projections(name)
            yield name, tensor
            if _K_WEIGHT.search(name):
                yield name.removesuffix("weight") + "bias", tensor.new_zeros(tensor.shape[0])

    def lora_target(self, module_name: str) -> tuple[str, int | str | None]:
        """A PEFT target module (checkpoint name) -> (our Linear, shard id in it or None)."""
        return lora_target_of(module_name, self.packed_modules_mapping, _rename_projections)

    def default_fp8_ignore(self) -> list[str]:
        return list(self.fp8_keep)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_into(
            self,
            self._hf_to_local(weights),
            self.packed_modules_mapping,
            self.ignore_unexpected_patterns,
        )


def _eager_decoder_layer(
    layer: BartDecoderLayer, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm Whisper decoder layer over one sequence [T, d] in plain torch (causal
    self-attention, cross-attention over [S, d]) -> (hidden states [T, d], cross-attention
    probabilities [heads, T, S] float32). Reads the layer's weights; its paged attention
    modules are not used."""
    assert layer.pre_norm, "Whisper decoder layers are pre-norm"
    num_heads = layer.self_attn.attn.num_heads
    head_dim = layer.self_attn.attn.head_size
    if num_heads * head_dim != hidden_states.shape[-1]:
        raise ValueError(
            "word timestamps need the whole decoder on one device (no tensor parallel)"
        )
    t, s = hidden_states.shape[0], encoder_hidden_states.shape[0]

    def split(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(n, num_heads, head_dim).transpose(0, 1)  # [heads, n, head_dim]

    def merge(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).reshape(t, num_heads * head_dim)  # [T, d]

    attn = layer.self_attn
    q, k, v = attn.qkv_proj(layer.self_attn_layer_norm(hidden_states)).chunk(3, dim=-1)
    out = F.scaled_dot_product_attention(split(q, t), split(k, t), split(v, t), is_causal=True)
    hidden_states = hidden_states + attn.out_proj(merge(out))

    cross = layer.encoder_attn
    q = split(cross.q_proj(layer.encoder_attn_layer_norm(hidden_states)), t)
    k, v = (split(x, s) for x in cross.kv_proj(encoder_hidden_states.to(q.dtype)).chunk(2, dim=-1))
    scores = (q @ k.transpose(1, 2)).float() * head_dim**-0.5  # [heads, T, S]
    probs = scores.softmax(dim=-1)
    hidden_states = hidden_states + cross.out_proj(merge(probs.to(v.dtype) @ v))

    hidden_states = hidden_states + layer.mlp(layer.final_layer_norm(hidden_states))
    return hidden_states, probs


def _make_log_mel(cfg: Any) -> LogMelSpectrogram:
    """The checkpoint folder's feature extractor when it has one, else the standard one for
    the config's number of mel bins (the filters depend on nothing else)."""
    from transformers import WhisperFeatureExtractor

    path = getattr(cfg, "name_or_path", "") or ""
    if path:
        try:
            return LogMelSpectrogram.from_pretrained(path)
        except OSError:
            pass  # no preprocessor_config.json there
    return LogMelSpectrogram.from_feature_extractor(
        WhisperFeatureExtractor(feature_size=cfg.num_mel_bins)
    )
