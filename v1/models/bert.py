"""BERT and RoBERTa/XLM-R encoders (bidirectional, post-LayerNorm, GELU) and their
sequence-classification heads, over packed requests with no KV cache. RoBERTa differs only in
its positions (padding_idx + 1 + index); checkpoints load with or without the `bert.`/`roberta.`
prefix. Each class declares its fp8 keep-list (`default_fp8_ignore`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from v1.attention.backend import AttentionType
from v1.attention.layer import Attention
from v1.models.layers.activation import get_act_fn, linear_act
from v1.models.layers.embedding import VocabEmbedding
from v1.models.layers.linear import ColumnLinear, Linear, QKVLinear, RowLinear
from v1.models.layers.norm import LayerNorm, add_layer_norm, use_fused_encoder
from v1.models.utils import load_weights_into
from v1.quantization.fp8 import linear_layers
from v1.quantization.fp8_recipes import covers

# Checkpoint names that never map to a parameter: position-id buffers and heads no task uses
# (masked-LM / next-sentence heads).
_ALWAYS_IGNORED = (
    r"embeddings\.position_ids$",
    r"embeddings\.token_type_ids$",
    r"^cls\.",
    r"^lm_head\.",
)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type={kind!r} is not supported (absolute only)")
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = VocabEmbedding(
            cfg.max_position_embeddings, cfg.hidden_size, shard_dim=None
        )
        self.token_type_embeddings = VocabEmbedding(
            cfg.type_vocab_size, cfg.hidden_size, shard_dim=None
        )
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        word = self.word_embeddings
        if word.tp is None and word.weight.is_contiguous() and use_fused_encoder(word.weight):
            # One kernel for the gathers, adds and LayerNorm (the torch path below is its
            # reference).
            from v1.models.layers.triton_encoder import embed_layer_norm_triton

            norm = self.LayerNorm
            assert norm.bias is not None
            return embed_layer_norm_triton(
                input_ids,
                positions,
                token_type_ids,
                word.weight,
                self.position_embeddings.weight,
                self.token_type_embeddings.weight,
                norm.weight,
                norm.bias,
                norm.eps,
            )
        embeddings = word(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            embeddings = embeddings + self.token_type_embeddings.weight[0]
        else:
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(embeddings)  # [T, hidden]


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.qkv_proj = QKVLinear(
            cfg.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            attn_type=AttentionType.ENCODER_ONLY,
            prefix=f"{prefix}.attn",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)  # 3 x [T, hidden]
        return self.attn(q, k, v)  # [T, hidden]


class BertSelfOutput(nn.Module):
    """dense + dropout-free residual + LayerNorm (post-LN)."""

    def __init__(self, cfg: Any, input_size: int) -> None:
        super().__init__()
        self.dense = RowLinear(input_size, cfg.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # One fused add + LayerNorm kernel on CUDA.
        return add_layer_norm(
            self.dense(hidden_states), residual, self.LayerNorm, store_residual=False
        )[0]


class BertAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, prefix=f"{prefix}.self")  # HF's module name
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = ColumnLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # GELU as the GEMM's epilogue on CUDA.
        return linear_act(self.dense, self.act, hidden_states)  # [T, intermediate]


class BertLayer(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, prefix=f"{prefix}.attention")
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attention(hidden_states)
        return self.output(self.intermediate(hidden_states), hidden_states)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(cfg, prefix=f"{prefix}.layer.{i}") for i in range(cfg.num_hidden_layers)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


def bert_fp8_ignore(model: nn.Module) -> list[str]:
    """The fp8 keep-list of the BERT family (BERT, RoBERTa, XLM-R and their heads): the first
    third of the encoder layers (rounded up) is fp8; later layers, pooler and heads are not
    (a small sentence-embedding model loses cosine to fp32 in every layer, the deeper most)."""
    quantized: list[str] = []
    ignore: list[str] = []
    for name, encoder in model.named_modules():
        if not isinstance(encoder, BertEncoder):
            continue
        prefix = f"{name}.layer" if name else "layer"
        num_layers = len(encoder.layer)
        num_fp8 = math.ceil(num_layers / 3)
        quantized += [f"{prefix}.{i}" for i in range(num_fp8)]
        ignore += [f"{prefix}.{i}" for i in range(num_fp8, num_layers)]
    # Pooler and task heads: every Linear outside the encoder layers.
    ignore += [
        name
        for name, _ in linear_layers(model)
        if not any(covers(entry, name) for entry in (*quantized, *ignore))
    ]
    return ignore


class BertPooler(nn.Module):
    """HF's `pooler`: tanh(dense(first token)); only BertForSequenceClassification uses it."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_token_hidden))


class BertModel(nn.Module):
    """The encoder: forward(input_ids [T], positions [T], token_type_ids [T] | None) -> [T, H].

    As an embedding model it loads without HF's `pooler.dense`: no pooling mode uses it
    (sentence-transformers and vLLM pool the token states), so it is skipped if present."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int | str]]] = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }
    checkpoint_prefix: ClassVar[str] = "bert"
    """The prefix a task model puts before the encoder's names (`bert.`, `roberta.`)."""

    def __init__(self, hf_config: Any, prefix: str = "", add_pooling_layer: bool = False) -> None:
        super().__init__()
        self.config = hf_config
        self.embeddings = BertEmbeddings(hf_config)
        self.encoder = BertEncoder(hf_config, prefix=f"{prefix}.encoder" if prefix else "encoder")
        self.pooler = BertPooler(hf_config) if add_pooling_layer else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (0-based within each request), token_type_ids: [T] int64 of
        packed requests -> hidden states [T, hidden]."""
        positions = self.embedding_positions(input_ids, positions)
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def embedding_positions(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def default_fp8_ignore(self) -> list[str]:
        return bert_fp8_ignore(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        strip = re.compile(rf"^{self.checkpoint_prefix}\.")
        renamed = ((strip.sub("", name), tensor) for name, tensor in weights)
        ignore = _ALWAYS_IGNORED if self.pooler is not None else (*_ALWAYS_IGNORED, r"^pooler\.")
        return load_weights_into(self, renamed, self.packed_modules_mapping, ignore)


class RobertaModel(BertModel):
    """BERT with positions counted from padding_idx + 1, skipping padding tokens (fairseq)."""

    checkpoint_prefix = "roberta"

    def __init__(self, hf_config: Any, prefix: str = "", add_pooling_layer: bool = False) -> None:
        super().__init__(hf_config, prefix, add_pooling_layer)
        self.padding_idx = hf_config.pad_token_id

    def embedding_positions(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Per request: padding_idx + (number of non-padding tokens up to and including this
        # one), padding tokens at padding_idx. Token t's request starts at t - positions[t].
        not_pad = (input_ids != self.padding_idx).long()  # [T]
        counts = torch.cumsum(not_pad, 0)
        start = torch.arange(input_ids.shape[0], device=input_ids.device) - positions
        before_start = counts[start] - not_pad[start]
        return (counts - before_start) * not_pad + self.padding_idx


class XLMRobertaModel(RobertaModel):
    pass


class _SequenceClassifier(nn.Module):
    """An encoder under `base_name` plus a head over its first token's hidden state."""

    base_cls: ClassVar[type[BertModel]]
    base_name: ClassVar[str]
    head_names: ClassVar[tuple[str, ...]] = ("classifier.",)

    @property
    def encoder_model(self) -> BertModel:
        return getattr(self, self.base_name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder_model(input_ids, positions, token_type_ids)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, num_labels] float32."""
        raise NotImplementedError

    def _checkpoint_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Puts the encoder's tensors under `base_name.` whatever prefix they came with."""
        prefix = f"{self.base_cls.checkpoint_prefix}."
        for name, tensor in weights:
            if name.startswith(self.head_names):
                yield name, tensor
            elif name.startswith(prefix):
                yield f"{self.base_name}.{name[len(prefix) :]}", tensor
            else:
                yield f"{self.base_name}.{name}", tensor

    def default_fp8_ignore(self) -> list[str]:
        return bert_fp8_ignore(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = self.base_cls.packed_modules_mapping
        ignore = tuple(p.replace("^", rf"^{self.base_name}\.", 1) for p in _ALWAYS_IGNORED)
        if self.encoder_model.pooler is None:  # RoBERTa heads have their own dense layer
            ignore = (*ignore, rf"^{self.base_name}\.pooler\.")
        return load_weights_into(self, self._checkpoint_names(weights), mapping, ignore)


class BertForSequenceClassification(_SequenceClassifier):
    """logits = classifier(tanh(pooler.dense(h[CLS]))), as transformers."""

    base_cls = BertModel
    base_name = "bert"

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.num_labels = hf_config.num_labels
        self.bert = self.base_cls(hf_config, prefix="bert", add_pooling_layer=True)
        self.classifier = Linear(hf_config.hidden_size, self.num_labels, bias=True)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(first_token_hidden)).float()


class RobertaClassificationHead(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.out_proj = Linear(cfg.hidden_size, cfg.num_labels, bias=True)

    def forward(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_token_hidden)))


class RobertaForSequenceClassification(_SequenceClassifier):
    """logits = out_proj(tanh(dense(h[<s>]))), as transformers' RobertaClassificationHead."""

    base_cls = RobertaModel
    base_name = "roberta"

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.num_labels = hf_config.num_labels
        self.roberta = self.base_cls(hf_config, prefix="roberta")
        self.classifier = RobertaClassificationHead(hf_config)

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(first_token_hidden).float()


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    base_cls = XLMRobertaModel


# Masked-LM checkpoints served as embedding models (the LM head is skipped at load).
class BertForMaskedLM(BertModel):
    pass


class RobertaForMaskedLM(RobertaModel):
    pass


class XLMRobertaForMaskedLM(XLMRobertaModel):
    pass
