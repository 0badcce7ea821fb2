"""Architecture name (as in a Hugging Face config's `architectures`) -> model class.

Entries are "module:Class" strings imported only when asked for, so listing an architecture
costs nothing and a broken model file breaks only that model.
"""

from __future__ import annotations

import importlib

from torch import nn

_LLAMA = "v1.models.llama:LlamaForCausalLM"

_DECODER_ONLY = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "GPT2LMHeadModel": "v1.models.gpt2:GPT2LMHeadModel",
}

# Encoder-decoder and encoder-only models: class name == the HF architecture name.
_ENCODER_DECODER = {
    "BartForConditionalGeneration": "v1.models.bart",
    "MBartForConditionalGeneration": "v1.models.bart",
    "MarianMTModel": "v1.models.bart",
    "WhisperForConditionalGeneration": "v1.models.whisper",
    "T5ForConditionalGeneration": "v1.models.t5",
    "MT5ForConditionalGeneration": "v1.models.t5",
}
_ENCODER_ONLY = {
    "T5EncoderModel": "v1.models.t5",
    "BertModel": "v1.models.bert",
    "BertForSequenceClassification": "v1.models.bert",
    "BertForMaskedLM": "v1.models.bert",
    "RobertaForMaskedLM": "v1.models.bert",
    "XLMRobertaForMaskedLM": "v1.models.bert",
    "RobertaModel": "v1.models.bert",
    "RobertaForSequenceClassification": "v1.models.bert",
    "XLMRobertaModel": "v1.models.bert",
    "XLMRobertaForSequenceClassification": "v1.models.bert",
}

MODEL_REGISTRY: dict[str, str] = {
    **_DECODER_ONLY,
    **{arch: f"{module}:{arch}" for arch, module in {**_ENCODER_DECODER, **_ENCODER_ONLY}.items()},
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture`; ValueError (listing the supported ones) if none does."""
    target = MODEL_REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
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
