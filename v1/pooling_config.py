"""What a model folder says about pooling, resolved into a `ModelPoolingConfig`: the
sentence-transformers files (modules.json, 1_Pooling/config.json, sentence_bert_config.json,
config_sentence_transformers.json) and the HF config (num_labels, Matryoshka flags). Torch-free;
`ModelInfo.pooling` loads it once per process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from v1.pooling_params import PoolingParams, PoolingParamsError

ST_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"

# sentence-transformers' Pooling concatenates the enabled modes in this order.
POOLING_MODE_KEYS = (
    ("cls", "pooling_mode_cls_token"),
    ("max", "pooling_mode_max_tokens"),
    ("mean", "pooling_mode_mean_tokens"),
    ("mean_sqrt_len", "pooling_mode_mean_sqrt_len_tokens"),
    ("weightedmean", "pooling_mode_weightedmean_tokens"),
    ("last", "pooling_mode_lasttoken"),
)
POOLING_MODES = tuple(mode for mode, _ in POOLING_MODE_KEYS)
CLASSIFIER_ACTIVATIONS = ("sigmoid", "softmax", "none")
_ST_ACTIVATIONS = {"Identity": "none", "Sigmoid": "sigmoid", "Softmax": "softmax"}


@dataclass(frozen=True)
class ModelPoolingConfig:
    """How one model pools, normalizes and classifies, with the limits of its inputs."""

    pooling_modes: tuple[str, ...] = ("cls",)
    """Token reductions of an embedding, concatenated in this order (sentence-transformers
    Pooling); CLS when the folder has no Pooling module (vLLM's default for BERT)."""
    normalize: bool = True
    """Default L2 normalization of embeddings: a sentence-transformers folder normalizes iff it
    lists a Normalize module; other folders normalize (as vLLM)."""
    hidden_size: int = 0
    """Width of the encoder's hidden states."""
    max_input_len: int = 512
    """Longest input of one request: the model's position limit, lowered to the
    sentence-transformers max_seq_length when the folder sets one."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """The only `dimensions` accepted, when the config lists them."""
    is_matryoshka: bool = False
    """Embeddings may be truncated (`dimensions`) to any width up to `embedding_size`."""
    num_labels: int | None = None
    """Classifier outputs; None for models without a sequence-classification head."""
    classifier_activation: str = "softmax"
    """sigmoid | softmax | none, applied to classifier logits when `activation` is on."""
    is_sentence_transformers: bool = False

    @property
    def embedding_size(self) -> int:
        return self.hidden_size * len(self.pooling_modes)

    @property
    def has_classifier(self) -> bool:
        return self.num_labels is not None


def load_pooling_config(
    model: str,
    revision: str | None,
    hf_config: Any,
    *,
    default_modes: tuple[str, ...],
    max_input_len: int,
    has_classifier: bool,
) -> ModelPoolingConfig:
    """The pooling behaviour of `model` (local folder or hub id): `default_modes` when the
    folder has no sentence-transformers Pooling module, inputs up to `max_input_len`."""
    cfg = hf_config
    st = read_sentence_transformers_files(model, revision)
    modules = st.get("modules.json")
    modes = default_modes
    normalize = True
    max_len = max_input_len
    if modules is not None:
        types = [m.get("type", "") for m in modules]
        unsupported = sorted(
            {t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)}
        )
        if unsupported:
            raise ValueError(
                f"{model}: sentence-transformers modules {unsupported} are not "
                f"supported (only Transformer, Pooling and Normalize)"
            )
        normalize = ST_NORMALIZE in types
        if ST_POOLING in types:
            modes = pooling_modes_of(st.get("1_Pooling/config.json") or {})
    seq_len = (st.get("sentence_bert_config.json") or {}).get("max_seq_length")
    if isinstance(seq_len, int) and seq_len > 0:
        max_len = min(max_len, seq_len)
    st_cfg = st.get("config_sentence_transformers.json") or {}
    dims = getattr(cfg, "matryoshka_dimensions", None) or st_cfg.get("matryoshka_dimensions")
    num_labels = getattr(cfg, "num_labels", None) if has_classifier else None
    return ModelPoolingConfig(
        pooling_modes=modes,
        normalize=normalize,
        hidden_size=cfg.hidden_size,
        max_input_len=max_len,
        matryoshka_dimensions=tuple(sorted(int(d) for d in dims)) if dims else None,
        is_matryoshka=bool(
            dims or getattr(cfg, "is_matryoshka", False) or st_cfg.get("is_matryoshka", False)
        ),
        num_labels=num_labels,
        classifier_activation=classifier_activation_of(cfg, num_labels or 1),
        is_sentence_transformers=modules is not None,
    )


def read_sentence_transformers_files(model: str, revision: str | None = None) -> dict[str, Any]:
    """relative path -> parsed JSON of the sentence-transformers files the folder has."""
    folder = model if os.path.isdir(model) else _hub_snapshot(model, revision)
    out: dict[str, Any] = {}
    for name in ST_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                try:
                    out[name] = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} is not valid JSON: {e}") from e
    return out


def _hub_snapshot(model: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=list(ST_FILES))


def pooling_modes_of(pooling_config: dict[str, Any]) -> tuple[str, ...]:
    """The modes a sentence-transformers 1_Pooling/config.json enables, in its concat order."""
    if pooling_config.get("include_prompt", True) is False:
        raise ValueError("sentence-transformers Pooling with include_prompt=False is not supported")
    mode = pooling_config.get("pooling_mode")
    if isinstance(mode, str):  # some exports name one mode instead of the flags
        alias = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}.get(mode, mode)
        if alias not in POOLING_MODES:
            raise ValueError(f"unknown sentence-transformers pooling_mode {mode!r}")
        return (alias,)
    modes = tuple(mode for mode, key in POOLING_MODE_KEYS if pooling_config.get(key, False))
    if not modes:
        raise ValueError("the sentence-transformers Pooling config enables no pooling mode")
    return modes


def classifier_activation_of(hf_config: Any, num_labels: int) -> str:
    """sentence-transformers CrossEncoder's activation when the config names one, else as
    vLLM and CrossEncoder default: sigmoid for one label or multi-label problems, softmax
    otherwise."""
    named = getattr(hf_config, "sbert_ce_default_activation_function", None)
    st_block = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st_block, dict):
        named = st_block.get("activation_fn", named)
    if isinstance(named, str):
        short = named.rsplit(".", 1)[-1]
        if short not in _ST_ACTIVATIONS:
            raise ValueError(f"unsupported classifier activation {named!r}")
        return _ST_ACTIVATIONS[short]
    problem = getattr(hf_config, "problem_type", None)
    if num_labels == 1 or problem == "multi_label_classification":
        return "sigmoid"
    return "softmax"


def validate_pooling_params(config: ModelPoolingConfig, params: PoolingParams) -> None:
    """PoolingParamsError (a ValueError) when `params` asks for something this model cannot do
    (called at the edge and at the core boundary)."""
    if params.task in ("classify", "score") and not config.has_classifier:
        raise PoolingParamsError(
            f"task {params.task!r} needs a sequence-classification model (cross-encoder); "
            f"this model has no classifier head (use task 'embed')",
            param="model",
        )
    if params.task == "score" and config.num_labels != 1:
        raise PoolingParamsError(
            f"task 'score' needs a classifier with one label; this one has {config.num_labels} "
            f"(use task 'classify')",
            param="model",
        )
    if params.dimensions is None:
        return
    if params.task != "embed":
        raise PoolingParamsError(
            f"dimensions applies to task 'embed' only, not {params.task!r}", param="dimensions"
        )
    if params.dimensions == config.embedding_size:
        return  # the native size: nothing to truncate, any model gives it
    if not config.is_matryoshka:
        raise PoolingParamsError(
            "this model does not support Matryoshka embeddings, so `dimensions` can only be its "
            f"native size {config.embedding_size} (a config with matryoshka_dimensions or "
            "is_matryoshka=True enables others)",
            param="dimensions",
        )
    if config.matryoshka_dimensions and params.dimensions not in config.matryoshka_dimensions:
        raise PoolingParamsError(
            f"dimensions={params.dimensions} is not one of the model's Matryoshka dimensions "
            f"{list(config.matryoshka_dimensions)}",
            param="dimensions",
        )
    if params.dimensions > config.embedding_size:
        raise PoolingParamsError(
            f"dimensions={params.dimensions} exceeds the embedding size {config.embedding_size}",
            param="dimensions",
        )
