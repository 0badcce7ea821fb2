"""The plan of one Whisper transcription: checked options -> window requests -> timed segments.

`TranscriptionPlanner` checks a call's options once; its `plan` of one waveform is a generator
that yields each window's request (built from the decoded audio) and takes its `WindowOutput`
back. Language detection, seek, conditioning, fallback and segments live here, not per driver.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from v1.audio import SAMPLE_RATE, AudioClip
from v1.core.protocol import EngineCoreRequest, now
from v1.engine.beam_search import BeamSearchParams
from v1.engine.inputs.whisper import WhisperInputBuilder, WhisperInputError
from v1.engine.output_processor import ParentRequest
from v1.engine.transcription.seek import (
    FRAMES_PER_SECOND,
    MAX_CONDITIONING_TEMPERATURE,
    SAMPLES_PER_FRAME,
    WINDOW_FRAMES,
    DecodeQuality,
    TemperatureFallback,
    Verdict,
    average_logprob,
    compression_ratio,
    seek_window,
)
from v1.engine.transcription.words import TranscriptionWord, WordClock
from v1.sampling_params import SamplingParams

WINDOW_SAMPLES = WINDOW_FRAMES * SAMPLES_PER_FRAME


class TranscriptionError(RuntimeError):
    """The engine failed a transcription request (the message names the input and window)."""


@dataclass
class TranscriptionSegment:
    """Text between two times, in seconds from the start of the audio. avg_logprob,
    compression_ratio, no_speech_prob and temperature describe the decoding of the window the
    segment comes from."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    """Text token ids (no special or timestamp tokens)."""
    avg_logprob: float
    """Mean raw logprob of the window's sampled tokens (EOS included, as openai-whisper)."""
    compression_ratio: float
    """Token-id bytes / their zlib-compressed size, of the window (`compression_ratio`)."""
    no_speech_prob: float | None
    """P(<|nospeech|>) at <|startoftranscript|>; None when the frontend does not carry it."""
    temperature: float = 0.0
    """Temperature of the decoding that was kept (above the first one after a fallback)."""
    seek: int = 0
    """Start of the window, in 10 ms frames (openai-whisper's `seek`)."""
    words: list[TranscriptionWord] | None = None
    """The segment's words with their times (word_timestamps only)."""


@dataclass
class TranscriptionResult:
    text: str
    language: str
    """ISO 639-1 code (detected when not given)."""
    duration: float
    """Seconds of audio."""
    segments: list[TranscriptionSegment] = field(default_factory=list)
    words: list[TranscriptionWord] | None = None
    """Every word with its times, in order (word_timestamps only)."""


@dataclass(frozen=True)
class WindowRequest:
    """One window request a plan asks a driver to run, built and checked: the driver hands
    `core_requests` to the engine as they are (`add_processed_request`)."""

    request_id: str
    prompt: dict[str, Any]
    """`{"prompt_token_ids": decoder prompt, "multi_modal_data": {"audio": AudioClip}}`: what
    the request was built from."""
    params: SamplingParams
    core_requests: list[EngineCoreRequest]
    """One per sample (best_of: n children of `request_id`); a beam search's base request."""
    beam: BeamSearchParams | None = None
    """Run as a beam search (temperature 0 with beam_size): the best beam is the output."""
    length_penalty: float | None = None
    """Ranks the n > 1 samples of a best_of request (openai-whisper's ranker)."""


@dataclass(frozen=True)
class WindowOutput:
    """What a plan needs back from one finished request."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Raw logprob of each sampled token (requests ask for logprobs=0)."""
    no_speech_prob: float | None
    token_times: list[float] | None = None
    """Boundary times of the generated text tokens, seconds from the window start (requests
    with word_timestamps): text token k spans [token_times[k], token_times[k + 1]]."""


Plan = Generator[WindowRequest, WindowOutput, TranscriptionResult]
"""One waveform's windows, one request at a time (each depends on the one before)."""


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

    def __post_init__(self) -> None:
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
        if self.word_timestamps and (self.beam_size or (self.best_of or 1) > 1):
            raise ValueError(
                "word_timestamps cannot be combined with beam_size or best_of > 1 yet (the "
                "alignment pass runs on a request's own tokens, not on a chosen beam or sample)"
            )

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


@dataclass
class FileProgress:
    """How far one file's plan got, for progress bars."""

    duration: float
    """Seconds of audio."""
    done: float = 0.0
    """Seconds before the current window (all of them once the plan returns)."""


@dataclass(frozen=True)
class _Attempt:
    """The decoding of one window that was kept (after any fallback)."""

    content: list[int]
    """Sampled tokens before EOS."""
    quality: DecodeQuality
    temperature: float
    verdict: Verdict
    """ACCEPT or SKIP."""
    token_times: list[float] | None = None
    """WindowOutput.token_times of this decoding."""


@dataclass(frozen=True)
class _DecodedWindow:
    seek: int
    """Start of the window in frames."""
    segments: list[tuple[float, float, list[int]]]
    """(start s, end s, text token ids) of each segment."""
    attempt: _Attempt


class TranscriptionPlanner:
    """Validated options of one `transcribe` call and the per-file plans that follow them.

    Everything is checked here, once (language, task, prompt, sampling params, alignment
    heads); the plans build their engine requests from the checked values and the builder's
    pieces without checking again."""

    def __init__(
        self,
        builder: WhisperInputBuilder,
        options: TranscriptionOptions,
        request_prefix: str,
        *,
        stream_text: bool = False,
    ) -> None:
        """`stream_text`: windows run with the engine's detokenizer on, so that a driver can
        pass their text on as it is decoded (otherwise only stop strings need it)."""
        self.builder = builder
        self.tokens = builder.tokens
        self.options = options
        self.prefix = request_prefix
        self.max_model_len = builder.max_model_len
        self.language = builder.check_language(options.language)
        self.task = builder.check_task(options.task)
        if options.prompt is not None and not isinstance(options.prompt, str):
            raise ValueError(f"prompt must be a string, got {type(options.prompt).__name__}")
        self.prompt_ids = builder.text_prompt_ids(options.prompt) if options.prompt else []
        if not isinstance(options.word_timestamps, bool):
            raise ValueError(f"word_timestamps must be a boolean, got {options.word_timestamps!r}")
        self.params = self._window_params(options.sampling_params, stream_text)
        if options.word_timestamps:
            builder.check_alignment_heads()
            self.params = self.params.clone(word_timestamps=True)
        self.fallback = options.fallback(self.params)

    def _window_params(self, params: SamplingParams | None, stream_text: bool) -> SamplingParams:
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=None)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(
                f"transcription samples one sequence per window (n=1), got n={params.n}"
            )
        params.validate_for_model(self.builder.model_config.vocab_size)
        if params.structured_outputs is not None:
            params.structured_outputs.validate()
        logprobs = 0 if params.logprobs is None else params.logprobs
        # Windows are read as token ids (text comes from the assembled segments), so the
        # engine's detokenizer runs only where stop strings or a text stream need the text.
        return params.clone(logprobs=logprobs, detokenize=stream_text or bool(params.stop))

    def continued(self, language: str, request_prefix: str) -> TranscriptionPlanner:
        """This planner for audio that follows audio it transcribed (the server's next chunk):
        in `language` (an ISO code a plan returned), without the prompt text (it preceded the
        earlier audio), request ids under `request_prefix`. Nothing is checked again."""
        assert not self.tokens.multilingual or language in self.tokens.language_ids, language
        following = copy.copy(self)
        following.language = language
        following.prompt_ids = []
        following.prefix = request_prefix
        return following

    # ---- the plan of one file ----
    def plan(self, index: int, samples: np.ndarray, progress: FileProgress | None = None) -> Plan:
        """The requests of one file (16 kHz float32 samples, as `load_audio` returns them),
        window after window; returns its result. Audio that fits one window without timestamps
        is one `<|notimestamps|>` request (transformers' short-form); anything else seeks on
        timestamps (openai-whisper's long-form)."""
        progress = progress or FileProgress(samples.shape[0] / SAMPLE_RATE)
        short_form = not self.options.timestamps and samples.shape[0] <= WINDOW_SAMPLES
        num_frames = samples.shape[0] // SAMPLES_PER_FRAME
        first = AudioClip(
            samples if short_form else samples[: min(num_frames, WINDOW_FRAMES) * SAMPLES_PER_FRAME]
        )
        language = self.language
        if language is None and self.tokens.multilingual:
            detected = yield self._detect_request(index, first)
            language = self._language_of(detected)
        language = language or "en"
        if short_form:
            attempt = yield from self._decode(index, "0", first, language, self.prompt_ids, False)
            text_ids = [t for t in attempt.content if t < self.tokens.eos]
            duration = samples.shape[0] / SAMPLE_RATE
            spans = [] if attempt.verdict is Verdict.SKIP else [(0.0, duration, text_ids)]
            windows = [_DecodedWindow(0, spans, attempt)]
        else:
            windows = yield from self._seek_windows(index, samples, first, language, progress)
        progress.done = progress.duration
        return self._assemble(samples, windows, language)

    def _seek_windows(
        self,
        index: int,
        samples: np.ndarray,
        first: AudioClip,
        language: str,
        progress: FileProgress,
    ) -> Generator[WindowRequest, WindowOutput, list[_DecodedWindow]]:
        """Windows from `seek` (frames): each starts where the previous one's last complete
        segment ended, or at its end when it ended on a complete segment or was silence."""
        num_frames = samples.shape[0] // SAMPLES_PER_FRAME
        history = list(self.prompt_ids)
        windows: list[_DecodedWindow] = []
        seek = 0
        while seek < num_frames:
            size = min(num_frames - seek, WINDOW_FRAMES)
            audio = (
                first
                if seek == 0
                else AudioClip(
                    samples[seek * SAMPLES_PER_FRAME : (seek + size) * SAMPLES_PER_FRAME]
                )
            )
            label = str(len(windows))
            attempt = yield from self._decode(index, label, audio, language, history, True)
            if attempt.verdict is Verdict.SKIP:
                windows.append(_DecodedWindow(seek, [], attempt))
                seek += size
            else:
                segments, next_seek = seek_window(
                    attempt.content,
                    seek=seek,
                    num_frames=size,
                    timestamp_begin=self.tokens.timestamp_begin,
                )
                spans = [
                    (s.start, s.end, [t for t in s.token_ids if t < self.tokens.eos])
                    for s in segments
                ]
                windows.append(_DecodedWindow(seek, spans, attempt))
                seek = next_seek
                conditioned = attempt.temperature <= MAX_CONDITIONING_TEMPERATURE
                if self.options.condition_on_previous_text and conditioned:
                    history += [t for s in segments for t in s.token_ids]
                    del history[: -self.builder.max_prompt_text_tokens]  # all a prompt keeps
                else:
                    history = []
            progress.done = min(seek, num_frames) * SAMPLES_PER_FRAME / SAMPLE_RATE
        return windows

    def _decode(
        self,
        index: int,
        label: str,
        audio: AudioClip,
        language: str,
        previous: list[int],
        timestamps: bool,
    ) -> Generator[WindowRequest, WindowOutput, _Attempt]:
        """One window at each fallback temperature until the verdict is not RETRY."""
        fallback = self.fallback
        ids = self._decoder_prompt(language, timestamps, previous)
        options = self.options
        for k, temperature in enumerate(fallback.temperatures):
            params = self.params.clone(temperature=temperature, whisper_timestamps=timestamps)
            request_id = f"{self.prefix}-{index}-{label}" + (f"-t{k}" if k else "")
            beam = None
            if temperature == 0.0 and options.beam_size is not None:
                max_tokens = params.max_tokens or self.max_model_len
                beam = BeamSearchParams(
                    beam_width=options.beam_size,
                    # The search's tokens fit the decoder after the prompt.
                    max_tokens=min(max_tokens, self.max_model_len - len(ids)),
                    length_penalty=1.0
                    if options.length_penalty is None
                    else options.length_penalty,
                    patience=options.patience,
                )
                params = params.clone(
                    n=1, temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=beam.ignore_eos
                )
            elif temperature > 0.0 and options.best_of is not None and options.best_of > 1:
                params = params.clone(n=options.best_of)
            out = yield self._window(request_id, ids, audio, params, beam)
            attempt = self._judge(out, temperature)
            if attempt.verdict is not Verdict.RETRY or fallback.is_last(k):
                if attempt.verdict is Verdict.RETRY:
                    attempt = dataclasses.replace(attempt, verdict=Verdict.ACCEPT)
                return attempt
        raise AssertionError("a fallback has at least one temperature")

    def _judge(self, out: WindowOutput, temperature: float) -> _Attempt:
        content = _until_eos(out.token_ids, self.tokens.eos)
        decoded = out.token_ids[: len(content) + 1]  # EOS counts, when there is one
        logprobs = out.logprobs[: len(decoded)] if out.logprobs else None
        quality = DecodeQuality(
            compression_ratio(decoded, self.builder.model_config.vocab_size),
            average_logprob(logprobs),
            out.no_speech_prob,
        )
        verdict = self.fallback.verdict(quality)
        return _Attempt(content, quality, temperature, verdict, out.token_times)

    def _detect_request(self, index: int, audio: AudioClip) -> WindowRequest:
        """One decoder step over the language tokens; it shares the first window's encoder
        output (same samples, same content hash) with the transcription request after it."""
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            allowed_token_ids=sorted(self.tokens.language_ids.values()),
        )
        return self._window(f"{self.prefix}-{index}-language", [self.tokens.sot], audio, params)

    def _language_of(self, output: WindowOutput) -> str:
        token_id = output.token_ids[0] if output.token_ids else None
        code = self.tokens.language_of_id.get(token_id) if token_id is not None else None
        if code is None:
            raise TranscriptionError(f"language detection returned token {token_id}, no language")
        return code

    # ---- engine requests ----
    def _decoder_prompt(self, language: str, timestamps: bool, previous: list[int]) -> list[int]:
        """`<|startofprev|> previous` `<|startoftranscript|><|lang|><|task|>[<|notimestamps|>]`
        (`WhisperInputBuilder.decoder_prompt`'s layout) from the checked language and task."""
        tokens = self.tokens
        ids: list[int] = []
        if previous:
            ids = [tokens.prev, *previous[-self.builder.max_prompt_text_tokens :]]
        ids.append(tokens.sot)
        if tokens.multilingual:
            ids += [tokens.language_ids[language], tokens.task_ids[self.task]]
        if not timestamps:
            ids.append(tokens.no_timestamps)
        return ids

    def _window(
        self,
        request_id: str,
        ids: list[int],
        audio: AudioClip,
        params: SamplingParams,
        beam: BeamSearchParams | None = None,
    ) -> WindowRequest:
        """The engine requests of one window: the audio's samples as they are (decoded and
        checked once, by `load_audio`) and its hash, shared by every request of the clip."""
        if len(ids) >= self.max_model_len:
            raise WhisperInputError(
                f"the decoder prompt has {len(ids)} tokens, which leaves no room to "
                f"generate within max_model_len={self.max_model_len}"
            )
        builder = self.builder

        def core_request(req_id: str, child_params: SamplingParams) -> EngineCoreRequest:
            return EngineCoreRequest(
                request_id=req_id,
                prompt_token_ids=list(ids),
                sampling_params=builder.sampling_params(child_params, len(ids)),
                encoder_input=builder.encoder_input(audio),
                eos_token_id=self.tokens.eos,
                arrival_time=now(),
            )

        if params.n == 1:
            core_requests = [core_request(request_id, params)]
        else:
            # n > 1 children (ids and seeds of ParentRequest) share one prompt and clip.
            parent = ParentRequest(request_id, params)
            child_ids = parent.child_ids
            first = core_request(child_ids[0], parent.child_params(0))
            core_requests = [first] + [
                builder.with_params(first, child_ids[i], parent.child_params(i))
                for i in range(1, params.n)
            ]
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"audio": audio}}
        return WindowRequest(
            request_id, prompt, params, core_requests, beam, self.options.length_penalty
        )

    # ---- results ----
    def _assemble(
        self, samples: np.ndarray, windows: list[_DecodedWindow], language: str
    ) -> TranscriptionResult:
        """Segments in time order, clamped into the audio and never overlapping; segments
        without text are dropped."""
        decode = self.builder.tokenizer.decode
        duration = samples.shape[0] / SAMPLE_RATE
        segments: list[TranscriptionSegment] = []
        all_text_ids: list[int] = []
        last_end = 0.0
        clock = None
        if self.options.word_timestamps:
            clock = WordClock(decode, self.tokens.eos, language, duration)
        for window in windows:
            quality = window.attempt.quality
            if clock is not None:
                times = window.attempt.token_times
                if times is None and window.segments:
                    raise TranscriptionError(
                        f"the window at {window.seek / FRAMES_PER_SECOND:.2f} s came back "
                        "without word timings"
                    )
                clock.start_window(times or [], window.seek / FRAMES_PER_SECOND)
            for start, end, text_ids in window.segments:
                words = clock.segment_words(text_ids) if clock is not None else None
                if not text_ids:
                    continue
                all_text_ids += text_ids
                start = min(max(start, last_end), duration)
                end = min(max(end, start), duration)
                segments.append(
                    TranscriptionSegment(
                        id=len(segments),
                        start=round(start, 3),
                        end=round(end, 3),
                        text=decode(text_ids),
                        tokens=text_ids,
                        avg_logprob=quality.avg_logprob,
                        compression_ratio=quality.compression_ratio,
                        no_speech_prob=quality.no_speech_prob,
                        temperature=window.attempt.temperature,
                        seek=window.seek,
                        words=words,
                    )
                )
                last_end = end
        # One segment (every short-form clip): its text is the whole text, decoded once.
        text = segments[0].text if len(segments) == 1 else decode(all_text_ids)
        return TranscriptionResult(
            text=text,
            language=language,
            duration=duration,
            segments=segments,
            words=[w for s in segments for w in s.words or []] if clock is not None else None,
        )


def _until_eos(token_ids: Sequence[int], eos: int) -> list[int]:
    ids = list(token_ids)
    return ids[: ids.index(eos)] if eos in ids else ids
