"""Model-kind strategies of the runner, chosen once per model (`make_model_state`)."""

from __future__ import annotations

from v1.config import ModelKind
from v1.worker.model_states.base import ModelState, StateContext


def make_model_state(ctx: StateContext) -> ModelState:
    """The strategy for the model's kind, built (and its model protocols checked) once the
    model is loaded."""
    info = ctx.config.model_config.info
    kind = info.kind
    if kind == ModelKind.DECODER_ONLY:
        from v1.worker.model_states.decoder_only import DecoderOnlyState

        return DecoderOnlyState(ctx)
    if kind == ModelKind.ENCODER_DECODER and info.is_whisper:
        from v1.worker.model_states.whisper import WhisperState

        return WhisperState(ctx)
    if kind == ModelKind.ENCODER_DECODER:
        from v1.worker.model_states.encoder_decoder import EncoderDecoderState

        return EncoderDecoderState(ctx)
    from v1.worker.model_states.encoder_only import EncoderOnlyState

    return EncoderOnlyState(ctx)
