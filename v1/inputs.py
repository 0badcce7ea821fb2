"""Prompt forms accepted by `LLM` and `AsyncLLM` (names follow vLLM).

A prompt is a string, a `TextPrompt`, a `TokensPrompt` or an `ExplicitEncoderDecoderPrompt`; what
each form means per model kind is described in DESIGN.md section 2 and `InputProcessor`.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """Text, tokenized by the engine; `multi_modal_data={"audio": (waveform, sample_rate)}`
    sends audio to Whisper's encoder and the text (if any) to its decoder."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """Token ids, used as they are; `token_type_ids` only for encoder-only (BERT) models."""

    prompt_token_ids: list[int]
    token_type_ids: NotRequired[list[int]]


SingletonPrompt: TypeAlias = str | TextPrompt | TokensPrompt
"""One prompt for one stack: the decoder of a decoder-only model, the encoder otherwise."""


class ExplicitEncoderDecoderPrompt(TypedDict):
    """Both halves of an encoder-decoder prompt. A decoder prompt of None starts the decoder
    from `decoder_start_token_id` alone."""

    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


class TextPairPrompt(TypedDict):
    """A text pair for a cross-encoder (tokenized as one input with segment ids)."""

    text: str
    text_pair: str


PromptType: TypeAlias = SingletonPrompt | ExplicitEncoderDecoderPrompt | TextPairPrompt
"""Every form a single prompt may take."""
