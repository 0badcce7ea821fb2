"""The sampling parameters every window request of a `transcribe` call runs with: the call's
SamplingParams checked (n = 1, the model's vocabulary), with faster-whisper's options as
sampling rules (suppress_tokens, suppress_blank, max_initial_timestamp, repetition_penalty,
no_repeat_ngram_size) and word timestamps."""

from __future__ import annotations

from typing import Any

from v1.engine.inputs.whisper import WhisperInputBuilder
from v1.engine.transcription.options import TranscriptionOptions
from v1.sampling_params import SamplingParams


def window_params(
    builder: WhisperInputBuilder, options: TranscriptionOptions, stream_text: bool
) -> SamplingParams:
    """`stream_text`: the engine detokenizes every window (a driver passes its text on as it
    comes); otherwise only where stop strings need the text."""
    params = _sampling_params(builder, options.sampling_params, stream_text)
    if options.word_timestamps:
        builder.check_alignment_heads()
        params = params.clone(word_timestamps=True)
    return _option_rules(builder, options, params)


def _option_rules(
    builder: WhisperInputBuilder, options: TranscriptionOptions, params: SamplingParams
) -> SamplingParams:
    """faster-whisper's suppress_tokens, suppress_blank, max_initial_timestamp,
    repetition_penalty and no_repeat_ngram_size as the window requests' sampling rules."""
    tokens = builder.tokens
    changes: dict[str, Any] = {}
    vocab = builder.model_config.vocab_size
    if options.suppress_tokens != (-1,):
        ids = set()
        for t in options.suppress_tokens or ():
            if t == -1:
                ids.update(builder.suppress_tokens)
            elif t >= vocab:
                raise ValueError(f"suppress_tokens: {t} is outside the vocabulary ({vocab})")
            else:
                ids.add(t)
        # As faster-whisper: the task and special prompt tokens are never sampled.
        ids.update(tokens.task_ids.values())
        ids.update(t for t in (tokens.sot, tokens.prev, tokens.no_speech) if t < vocab)
        changes["suppress_tokens"] = sorted(ids)
    begin: list[int] | None = None
    if not options.suppress_blank:
        begin = []
    index = round(options.max_initial_timestamp / 0.02)
    limit = tokens.max_initial_timestamp_index
    if limit is not None and index > limit:
        raise ValueError(
            f"max_initial_timestamp must be at most the model's {limit * 0.02:.2f} s, "
            f"got {options.max_initial_timestamp}"
        )
    if limit is None or index < limit:
        if begin is None:
            begin = list(builder.begin_suppress_tokens)
        begin += range(tokens.timestamp_begin + index + 1, vocab)
    if begin is not None:
        changes["begin_suppress_tokens"] = begin
    if options.repetition_penalty != 1.0:
        changes["repetition_penalty"] = float(options.repetition_penalty)
    if options.no_repeat_ngram_size:
        changes["no_repeat_ngram_size"] = options.no_repeat_ngram_size
    return params.clone(**changes) if changes else params


def _sampling_params(
    builder: WhisperInputBuilder, params: SamplingParams | None, stream_text: bool
) -> SamplingParams:
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=None)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(f"transcription samples one sequence per window (n=1), got n={params.n}")
    params.validate_for_model(builder.model_config.vocab_size)
    if params.structured_outputs is not None:
        params.structured_outputs.validate()
    logprobs = 0 if params.logprobs is None else params.logprobs
    # Windows are read as token ids (text comes from the assembled segments), so the
    # engine's detokenizer runs only where stop strings or a text stream need the text.
    return params.clone(logprobs=logprobs, detokenize=stream_text or bool(params.stop))
