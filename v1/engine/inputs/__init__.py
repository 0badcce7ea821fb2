"""One input builder per model kind, chosen once: each turns a user prompt into the
EngineCoreRequest of its kind (docs/architecture.md, `v1/engine/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1.config import ModelKind
from v1.engine.inputs.base import InputBuilder, make_encoder_input

if TYPE_CHECKING:
    from v1.model_info import ModelInfo

__all__ = ["InputBuilder", "make_encoder_input", "make_input_builder"]


def make_input_builder(
    info: ModelInfo, tokenizer: Any, *, max_num_batched_tokens: int | None = None
) -> InputBuilder:
    """The builder of `info`'s model kind (Whisper's audio prompts are a kind of their own);
    `max_num_batched_tokens` bounds an encoder-only input, which runs whole in one step."""
    mc = info.model_config
    if info.is_whisper:
        from v1.engine.inputs.whisper import WhisperInputBuilder

        return WhisperInputBuilder(mc, tokenizer, info)
    if info.kind == ModelKind.ENCODER_ONLY:
        from v1.engine.inputs.encoder_only import EncoderOnlyInputBuilder

        return EncoderOnlyInputBuilder(
            mc, tokenizer, info, max_num_batched_tokens=max_num_batched_tokens
        )
    if info.kind == ModelKind.ENCODER_DECODER:
        from v1.engine.inputs.encoder_decoder import EncoderDecoderInputBuilder

        return EncoderDecoderInputBuilder(mc, tokenizer, info)
    from v1.engine.inputs.decoder_only import DecoderOnlyInputBuilder

    return DecoderOnlyInputBuilder(mc, tokenizer, info)
