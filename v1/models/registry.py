"""One torch-free `ModelSpec` row per model family: every fact about a family the engine needs
before (or without) building the model: kind, class, lengths, sliding window, pooling, speech.

Classes are "module:Class" strings imported only when asked for. Nothing here imports torch or
any v1 module above floor 0; code outside `v1/models/` asks a row instead of a `model_type`.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


class ModelKind(enum.Enum):
    DECODER_ONLY = "decoder_only"
    ENCODER_DECODER = "encoder_decoder"
    ENCODER_ONLY = "encoder_only"


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len")
"""Config fields of a decoder's learned or rotary position limit, the first positive one wins."""
ENCODER_POSITION_FIELDS = ("max_position_embeddings", "n_positions")
DEFAULT_ENCODER_LEN = 512
"""An encoder's input limit when its config names none (T5's relative positions)."""
WHISPER_TASKS = ("transcribe", "translate")
"""The tasks a Whisper prompt names (<|transcribe|>, <|translate|>)."""


class SlidingWindow(enum.Enum):
    """How a family's config says which layers attend within `sliding_window` (transformers 5)."""

    LAYER_TYPES = "layer_types"
    """Windowed when `layer_types` marks some layer "sliding_attention", or lists none."""
    EVERY_LAYER = "every_layer"
    """Mistral: every layer is windowed when `sliding_window` is set, whatever layer_types says."""
    MAX_WINDOW_LAYERS = "max_window_layers"
    """Qwen2: as LAYER_TYPES; without layer_types, the layers >= `max_window_layers`."""


def _first_positive(cfg: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """The facts of one model family, read by the config, ModelInfo, the runner and the loader."""

    family: str
    kind: ModelKind
    classes: Mapping[str, str]
    """HF architecture (a config's `architectures[0]`) -> the "module:Class" serving it."""
    model_types: Mapping[str, str] = field(default_factory=dict)
    """HF model_type -> the architecture it means when a config lists no `architectures`."""
    attention_bias: str | None = None
    """A bias added to attention scores ("relative_position": T5's buckets), which only
    backends taking a bias serve; None: plain scaled dot-product attention."""
    decoder_len_fields: tuple[str, ...] | None = POSITION_FIELDS
    """Config fields of the decoder's length limit (first positive wins); None: unbounded
    (T5's relative positions: max_model_len then defaults to 512)."""
    encoder_len_fields: tuple[str, ...] = ENCODER_POSITION_FIELDS
    """Config fields of the encoder's input limit (first positive wins, else 512)."""
    fixed_encoder_len: bool = False
    """Every encoder input is exactly the limit (Whisper: one 30 s window of 1500 positions)."""
    pad_offset_positions: bool = False
    """Positions start after `pad_token_id` (RoBERTa), so the limit is that much lower."""
    encoder_inputs_per_step: int = 1
    """The default per-step encoder budget, in whole encoder inputs (Whisper: 16 windows)."""
    sliding_window: SlidingWindow = SlidingWindow.LAYER_TYPES
    pooling_modes: tuple[str, ...] = ("cls",)
    """Encoder-only: the pooling of a folder without a sentence-transformers Pooling module."""
    speech_tasks: tuple[str, ...] = ()
    """Speech input (log-mel audio, Whisper's prompt and timestamp tokens) and the tasks its
    prompt names; empty for text models."""

    def max_decoder_len(self, hf_config: Any) -> int | None:
        """The model's own decoder length limit (None: unbounded)."""
        if self.decoder_len_fields is None:
            return None
        return _first_positive(hf_config, self.decoder_len_fields)

    def max_encoder_len(self, hf_config: Any) -> int:
        """The limit of one encoder input, in encoder positions (for a family with an encoder)."""
        limit = _first_positive(hf_config, self.encoder_len_fields)
        if limit and self.pad_offset_positions:
            limit = limit - getattr(hf_config, "pad_token_id", 1) - 1
        return limit or DEFAULT_ENCODER_LEN

    def window(self, hf_config: Any) -> int | None:
        """The attention window transformers applies to some layer (None: every layer attends
        to the whole sequence); `use_sliding_window=False` turns it off for every family."""
        window = getattr(hf_config, "sliding_window", None)
        if not isinstance(window, int) or window <= 0:
            return None
        if getattr(hf_config, "use_sliding_window", True) is False:
            return None
        if self.sliding_window == SlidingWindow.EVERY_LAYER:
            return window
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is None and self.sliding_window == SlidingWindow.MAX_WINDOW_LAYERS:
            windowed = hf_config.num_hidden_layers - getattr(hf_config, "max_window_layers", 0)
            layer_types = ["sliding_attention"] * max(windowed, 0)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        return window

    @staticmethod
    def has_classifier(architecture: str) -> bool:
        """A sequence-classification head (classify; score as a cross-encoder)."""
        return architecture.endswith("ForSequenceClassification")


def _same_name(module: str, *architectures: str) -> dict[str, str]:
    """Classes named as the architectures they serve."""
    return {arch: f"{module}:{arch}" for arch in architectures}


_LLAMA = "v1.models.llama:LlamaForCausalLM"
_BERT_ARCHS = ("Model", "ForMaskedLM", "ForSequenceClassification")

SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "llama",
        ModelKind.DECODER_ONLY,
        {"LlamaForCausalLM": _LLAMA},
        {"llama": "LlamaForCausalLM"},
    ),
    ModelSpec(
        "mistral",
        ModelKind.DECODER_ONLY,
        {"MistralForCausalLM": _LLAMA},
        {"mistral": "MistralForCausalLM"},
        sliding_window=SlidingWindow.EVERY_LAYER,
    ),
    ModelSpec(
        "qwen2",
        ModelKind.DECODER_ONLY,
        {"Qwen2ForCausalLM": _LLAMA},
        {"qwen2": "Qwen2ForCausalLM"},
        sliding_window=SlidingWindow.MAX_WINDOW_LAYERS,
    ),
    ModelSpec(
        "gpt2",
        ModelKind.DECODER_ONLY,
        _same_name("v1.models.gpt2", "GPT2LMHeadModel"),
        {"gpt2": "GPT2LMHeadModel"},
    ),
    ModelSpec(
        "bart",
        ModelKind.ENCODER_DECODER,
        _same_name(
            "v1.models.bart",
            "BartForConditionalGeneration",
            "MBartForConditionalGeneration",
            "MarianMTModel",
        ),
        {
            "bart": "BartForConditionalGeneration",
            "mbart": "MBartForConditionalGeneration",
            "marian": "MarianMTModel",
        },
    ),
    ModelSpec(
        "t5",
        ModelKind.ENCODER_DECODER,
        _same_name("v1.models.t5", "T5ForConditionalGeneration", "MT5ForConditionalGeneration"),
        {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration"},
        attention_bias="relative_position",
        decoder_len_fields=None,
    ),
    ModelSpec(
        "t5-encoder",
        ModelKind.ENCODER_ONLY,
        _same_name("v1.models.t5", "T5EncoderModel"),
        attention_bias="relative_position",
        decoder_len_fields=None,
        pooling_modes=("mean",),  # sentence-t5 style encoders mean-pool
    ),
    ModelSpec(
        "whisper",
        ModelKind.ENCODER_DECODER,
        _same_name("v1.models.whisper", "WhisperForConditionalGeneration"),
        {"whisper": "WhisperForConditionalGeneration"},
        decoder_len_fields=("max_target_positions",),  # 448
        encoder_len_fields=("max_source_positions",),  # 1500
        fixed_encoder_len=True,
        encoder_inputs_per_step=16,
        speech_tasks=WHISPER_TASKS,
    ),
    ModelSpec(
        "bert",
        ModelKind.ENCODER_ONLY,
        _same_name("v1.models.bert", *(f"Bert{suffix}" for suffix in _BERT_ARCHS)),
        {"bert": "BertModel"},
    ),
    ModelSpec(
        "roberta",
        ModelKind.ENCODER_ONLY,
        _same_name(
            "v1.models.bert",
            *(
                f"{prefix}{suffix}"
                for prefix in ("Roberta", "XLMRoberta")
                for suffix in _BERT_ARCHS
            ),
        ),
        {"roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"},
        pad_offset_positions=True,
    ),
)

_BY_ARCHITECTURE: dict[str, ModelSpec] = {arch: s for s in SPECS for arch in s.classes}
_BY_MODEL_TYPE: dict[str, str] = {t: arch for s in SPECS for t, arch in s.model_types.items()}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def architecture_for(architectures: list[str] | None, model_type: str) -> str:
    """A config's architecture: its first listed one, else the one its model_type means (else
    the model_type itself, which no row serves)."""
    if architectures:
        return architectures[0]
    return _BY_MODEL_TYPE.get(model_type, model_type)


def get_model_spec(architecture: str) -> ModelSpec:
    """The row serving `architecture`; ValueError (listing the supported ones) if none does."""
    spec = _BY_ARCHITECTURE.get(architecture)
    if spec is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return spec


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture`, imported now; ValueError if no row serves it."""
    target = get_model_spec(architecture).classes[architecture]
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ImportError(
            f"{architecture} is registered to {module_name}, which does not exist"
        ) from e
    if not hasattr(module, class_name):
        raise ImportError(
            f"{architecture} is registered to {target}, but {module_name} has no {class_name}"
        )
    return getattr(module, class_name)
