"""The checked options of one Whisper `transcribe` call (openai-whisper's and faster-whisper's
names), shared by every file of the call."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from v1.audio.vad import VadOptions
from v1.engine.transcription.seek import TemperatureFallback
from v1.sampling_params import SamplingParams


def parse_clip_timestamps(value: str | Sequence[float] | None) -> tuple[float, ...]:
    """faster-whisper's clip_timestamps ("0,10.5,20" or [0, 10.5, 20]) as checked numbers:
    start, end pairs in increasing order (a last start alone runs to the end); () for none."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return ()
        try:
            numbers = [float(x) for x in text.split(",")]
        except ValueError as e:
            raise ValueError(f"clip_timestamps must be numbers separated by commas: {e}") from e
    elif isinstance(value, Sequence):
        numbers = []
        for x in value:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"clip_timestamps must be numbers, got {x!r}")
            numbers.append(float(x))
    else:
        raise ValueError(f"clip_timestamps must be a string or a list, got {value!r}")
    if any(not math.isfinite(x) or x < 0 for x in numbers):
        raise ValueError(f"clip_timestamps must be finite seconds >= 0, got {numbers}")
    if any(b <= a for a, b in zip(numbers, numbers[1:], strict=False)):
        raise ValueError(f"clip_timestamps must increase, got {numbers}")
    return tuple(numbers)


@dataclass(frozen=True)
class TranscriptionOptions:
    """The options of one `transcribe` call (every file gets the same)."""

    language: str | None = None
    """ISO code or name; None detects it from the first window (multilingual models)."""
    task: str = "transcribe"
    """"transcribe" or "translate" (to English)."""
    timestamps: bool = False
    """Decode short audio with timestamps too (audio over 30 s always is: windows seek on
    them) and report timed segments."""
    prompt: str | None = None
    """Text that precedes the audio (vocabulary, spelling, style), as the first window's
    previous text."""
    sampling_params: SamplingParams | None = None
    """Per window: default greedy with no token cap; n must be 1."""
    condition_on_previous_text: bool = True
    """Prompt each window with the text of the windows before it (`<|startofprev|>`); reset
    after a window decoded above temperature 0.5."""
    temperature: float | tuple[float, ...] | None = None
    """Fallback temperatures; one number disables fallback. Default: from sampling_params'
    temperature (0) up to 1.0 in steps of 0.2."""
    compression_ratio_threshold: float | None = 2.4
    """Decode again, hotter, when the text's gzip compression ratio is above this."""
    logprob_threshold: float | None = -1.0
    """Decode again, hotter, when the mean token logprob is below this."""
    no_speech_threshold: float | None = 0.6
    """With a mean logprob below logprob_threshold and P(<|nospeech|>) above this, the window
    is silence: skipped."""
    word_timestamps: bool = False
    """Time every word (cross-attention alignment heads and DTW, as openai-whisper): the
    result and its segments get `words`."""
    beam_size: int | None = None
    """Decode at temperature 0 with beam search of this width (openai-whisper's beam_size;
    scored and finished as transformers' generate(num_beams=...)). None: greedy."""
    best_of: int | None = None
    """At temperatures above 0, sample this many candidates and keep the most likely."""
    patience: float | None = None
    """Beam search keeps and waits for round(beam_size * patience) finished beams."""
    length_penalty: float | None = None
    """Beam search: scores are sum(logprobs) / length ** length_penalty (None: 1.0).
    best_of: openai-whisper's ranking, sum / length (None) or sum / ((5 + length) / 6) ** it."""
    # ---- faster-whisper's options ----
    initial_prompt: str | None = None
    """faster-whisper's name for `prompt` (give one of them)."""
    vad_filter: bool = False
    """Drop the non-speech parts (Silero VAD, `v1.audio.vad`) before decoding; times stay on
    the original recording's clock."""
    vad_parameters: VadOptions | dict[str, Any] | None = None
    """`VadOptions` or a dict of its fields (faster-whisper's defaults when None)."""
    batch_size: int | None = None
    """Decode the chunks of a file (VAD speech chunks of at most 30 s with vad_filter, plain
    30 s chunks without) in parallel, this many at once, each chunk on its own (no previous
    text across chunks): faster-whisper's BatchedInferencePipeline. None: sequential seek."""
    clip_timestamps: str | Sequence[float] | None = None
    """Only these spans are decoded: "start,end,start,end,..." seconds (a last start without
    end runs to the end of the audio) or a list of numbers; times stay the recording's."""
    hotwords: str | None = None
    """Hint phrase put in the previous-text prompt of every window but the one that starts
    with `prefix` (faster-whisper's `get_prompt`)."""
    prefix: str | None = None
    """Text forced at the start of the window at 0 s (it is part of the output); with
    timestamps that window is `<|0.00|> prefix` and sampling goes on from there with
    timestamps (faster-whisper's rule: the first token after the prefix is free)."""
    hallucination_silence_threshold: float | None = None
    """With word_timestamps: skip silences longer than this (s) around segments whose words
    look hallucinated (openai-whisper's / faster-whisper's rule)."""
    multilingual: bool = False
    """Detect the language of every window (segments carry theirs)."""
    without_timestamps: bool = False
    """Decode every window with <|notimestamps|>: one segment per 30 s window."""
    max_initial_timestamp: float = 1.0
    """The first timestamp of a window is at most this (s); at most the model's own limit."""
    suppress_tokens: Sequence[int] | None = (-1,)
    """Token ids never sampled; -1 stands for the model's default set (non-speech symbols)."""
    suppress_blank: bool = True
    """No blank (" ") or <|endoftext|> as a window's first sampled token."""
    repetition_penalty: float = 1.0
    """Penalty on the logits of tokens already generated (> 1 discourages repeats)."""
    no_repeat_ngram_size: int = 0
    """No n-gram of this size is generated twice (0: off)."""

    def __post_init__(self) -> None:
        self._check_window_options()
        self._check_decoding_options()

    def _check_window_options(self) -> None:
        """What a file's windows are cut from and prompted with: prompt, VAD, batching, clip
        timestamps, hotwords / prefix, the hallucination threshold, timestamps."""
        if self.initial_prompt is not None:
            if self.prompt is not None:
                raise ValueError("give prompt or initial_prompt, not both")
            object.__setattr__(self, "prompt", self.initial_prompt)
            object.__setattr__(self, "initial_prompt", None)  # one name from here on
        for name in ("vad_filter", "multilingual", "without_timestamps", "suppress_blank"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        object.__setattr__(self, "vad_parameters", VadOptions.from_value(self.vad_parameters))
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, int)
            or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        object.__setattr__(self, "clip_timestamps", parse_clip_timestamps(self.clip_timestamps))
        if self.clip_timestamps and (self.vad_filter or self.batch_size is not None):
            raise ValueError("clip_timestamps cannot be combined with vad_filter or batch_size")
        for name in ("hotwords", "prefix"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        threshold = self.hallucination_silence_threshold
        if threshold is not None:
            if (
                isinstance(threshold, bool)
                or not isinstance(threshold, (int, float))
                or not (math.isfinite(threshold) and threshold > 0)
            ):
                raise ValueError(
                    f"hallucination_silence_threshold must be a number > 0, got {threshold!r}"
                )
            if not self.word_timestamps:
                raise ValueError("hallucination_silence_threshold needs word_timestamps=True")
        if self.without_timestamps and self.timestamps:
            raise ValueError("timestamps and without_timestamps contradict each other")

    def _check_decoding_options(self) -> None:
        """How each window decodes: its first timestamp, suppressed tokens, penalties, beams."""
        mit = self.max_initial_timestamp
        if (
            isinstance(mit, bool)
            or not isinstance(mit, (int, float))
            or not (math.isfinite(mit) and mit >= 0)
        ):
            raise ValueError(f"max_initial_timestamp must be a number >= 0, got {mit!r}")
        if self.suppress_tokens is not None:
            if isinstance(self.suppress_tokens, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= -1
                for t in self.suppress_tokens
            ):
                raise ValueError(
                    f"suppress_tokens must be a list of token ids (-1: the model's default "
                    f"set), got {self.suppress_tokens!r}"
                )
            object.__setattr__(self, "suppress_tokens", tuple(self.suppress_tokens))
        rp = self.repetition_penalty
        if (
            isinstance(rp, bool)
            or not isinstance(rp, (int, float))
            or not (math.isfinite(rp) and rp > 0)
        ):
            raise ValueError(f"repetition_penalty must be a number > 0, got {rp!r}")
        ngram = self.no_repeat_ngram_size
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 0:
            raise ValueError(f"no_repeat_ngram_size must be an integer >= 0, got {ngram!r}")
        for name in ("beam_size", "best_of"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10
            ):
                raise ValueError(f"{name} must be an integer in [1, 10], got {value!r}")
        if self.patience is not None and self.beam_size is None:
            raise ValueError("patience needs beam_size")
        for name in ("patience", "length_penalty"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.patience is not None and not 0 < self.patience <= 100:
            raise ValueError(f"patience must be in (0, 100], got {self.patience!r}")

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> TranscriptionOptions:
        """Options from keyword arguments; ValueError naming an unknown one."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"unknown transcription option(s) {unknown}; expected some of {names}")
        return cls(**options)

    def fallback(self, params: SamplingParams) -> TemperatureFallback:
        thresholds = {
            "compression_ratio_threshold": self.compression_ratio_threshold,
            "logprob_threshold": self.logprob_threshold,
            "no_speech_threshold": self.no_speech_threshold,
        }
        if self.temperature is None:
            return TemperatureFallback.starting_at(params.temperature, **thresholds)
        temperatures = self.temperature
        if isinstance(temperatures, (int, float)) and not isinstance(temperatures, bool):
            temperatures = (temperatures,)
        elif not isinstance(temperatures, Sequence) or isinstance(temperatures, str):
            raise ValueError(
                f"temperature must be a number or a sequence of numbers, got {temperatures!r}"
            )
        return TemperatureFallback(tuple(temperatures), **thresholds)
