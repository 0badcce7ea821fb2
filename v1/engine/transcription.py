"""Whisper transcription over the engine: audio -> seek-based 30 s windows -> timed segments.

Each file's plan (language detection, windows that start where the last complete segment ended,
previous-text conditioning, temperature fallback, segment assembly) is a generator shared by
two drivers: `Transcriber` over the synchronous `LLMEngine` (add_request / step) and
`AsyncTranscriber` over `AsyncLLM.generate`. A plan yields the requests it needs next and gets
their outputs back; a driver runs many files' plans at once, so their windows share each step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from v1.audio import SAMPLE_RATE, AudioClip, AudioError, load_audio
from v1.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    advance_beam_searches,
    beam_step_requests,
    make_beam_search,
    run_beam_search_async,
    take_step_request_ids,
)
from v1.engine.whisper_decoding import (
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
from v1.engine.whisper_inputs import WINDOW_SECONDS, WhisperInputBuilder
from v1.engine.word_timestamps import TranscriptionWord, WordClock
from v1.sampling_params import SamplingParams

NO_SPEECH_PROB = "no_speech_prob"
TOKEN_TIMES = "token_times"
WINDOW_SAMPLES = WINDOW_FRAMES * SAMPLES_PER_FRAME
_T = TypeVar("_T")


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
    """One request a plan asks a driver to run."""

    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
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


Plan = Generator[list[WindowRequest], list[WindowOutput], TranscriptionResult]


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
    """Validated options of one `transcribe` call and the per-file plans that follow them."""

    def __init__(
        self, builder: WhisperInputBuilder, options: TranscriptionOptions, request_prefix: str
    ) -> None:
        self.builder = builder
        self.tokens = builder.tokens
        self.options = options
        self.prefix = request_prefix
        self.language = builder.check_language(options.language)
        builder.check_task(options.task)
        if options.prompt is not None and not isinstance(options.prompt, str):
            raise ValueError(f"prompt must be a string, got {type(options.prompt).__name__}")
        self.prompt_ids = builder.text_prompt_ids(options.prompt) if options.prompt else []
        if not isinstance(options.word_timestamps, bool):
            raise ValueError(f"word_timestamps must be a boolean, got {options.word_timestamps!r}")
        self.params = self._window_params(options.sampling_params)
        if options.word_timestamps:
            builder.check_alignment_heads()
            self.params = self.params.clone(word_timestamps=True)
        self.fallback = options.fallback(self.params)

    @staticmethod
    def _window_params(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=None)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(
                f"transcription samples one sequence per window (n=1), got n={params.n}"
            )
        logprobs = 0 if params.logprobs is None else params.logprobs
        # Windows are read as token ids (text comes from the assembled segments), so the
        # engine's detokenizer runs only where stop strings need the text.
        return params.clone(logprobs=logprobs, detokenize=bool(params.stop))

    # ---- the plan of one file ----
    def plan(self, index: int, samples: np.ndarray, progress: FileProgress | None = None) -> Plan:
        """The requests of one file, window after window; returns its result. Audio that fits
        one window without timestamps is one `<|notimestamps|>` request (transformers'
        short-form); anything else seeks on timestamps (openai-whisper's long-form)."""
        progress = progress or FileProgress(samples.shape[0] / SAMPLE_RATE)
        short_form = not self.options.timestamps and samples.shape[0] <= WINDOW_SAMPLES
        num_frames = samples.shape[0] // SAMPLES_PER_FRAME
        first = AudioClip(
            samples if short_form else samples[: min(num_frames, WINDOW_FRAMES) * SAMPLES_PER_FRAME]
        )
        language = self.language
        if language is None and self.tokens.multilingual:
            (detected,) = yield [self._detect_request(index, first)]
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
    ) -> Generator[list[WindowRequest], list[WindowOutput], list[_DecodedWindow]]:
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
    ) -> Generator[list[WindowRequest], list[WindowOutput], _Attempt]:
        """One window at each fallback temperature until the verdict is not RETRY."""
        fallback = self.fallback
        ids = self.builder.decoder_prompt(
            language=language,
            task=self.options.task,
            timestamps=timestamps,
            previous_text_ids=previous,
        )
        options = self.options
        for k, temperature in enumerate(fallback.temperatures):
            params = self.params.clone(temperature=temperature, whisper_timestamps=timestamps)
            request_id = f"{self.prefix}-{index}-{label}" + (f"-t{k}" if k else "")
            prompt = {"prompt_token_ids": ids, "multi_modal_data": _audio(audio)}
            beam = None
            if temperature == 0.0 and options.beam_size is not None:
                beam = BeamSearchParams(
                    beam_width=options.beam_size,
                    max_tokens=params.max_tokens
                    or self.builder.model_config.effective_max_model_len,
                    length_penalty=1.0
                    if options.length_penalty is None
                    else options.length_penalty,
                    patience=options.patience,
                )
            elif temperature > 0.0 and options.best_of is not None and options.best_of > 1:
                params = params.clone(n=options.best_of)
            request = WindowRequest(request_id, prompt, params, beam, options.length_penalty)
            (out,) = yield [request]
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
        prompt = {"prompt_token_ids": [self.tokens.sot], "multi_modal_data": _audio(audio)}
        return WindowRequest(f"{self.prefix}-{index}-language", prompt, params)

    def _language_of(self, output: WindowOutput) -> str:
        token_id = output.token_ids[0] if output.token_ids else None
        code = self.tokens.language_of_id.get(token_id) if token_id is not None else None
        if code is None:
            raise TranscriptionError(f"language detection returned token {token_id}, no language")
        return code

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
        return TranscriptionResult(
            text=decode(all_text_ids),
            language=language,
            duration=duration,
            segments=segments,
            words=[w for s in segments for w in s.words or []] if clock is not None else None,
        )


def _audio(clip: AudioClip) -> dict[str, Any]:
    # One clip per window: its requests (language detection, fallback retries) share one hash.
    return {"audio": clip}


def _until_eos(token_ids: Sequence[int], eos: int) -> list[int]:
    ids = list(token_ids)
    return ids[: ids.index(eos)] if eos in ids else ids


def load_audio_inputs(audio: Any) -> list[np.ndarray]:
    """One source or a list of them (path, bytes, `(samples, sample_rate)`) -> float32 16 kHz
    waveforms; every input is checked before any request is made."""
    sources = audio if isinstance(audio, list) else [audio]
    if not sources:
        raise AudioError("no audio given (an empty list)")
    waveforms = []
    for i, source in enumerate(sources):
        try:
            waveforms.append(load_audio(source))
        except AudioError as e:
            where = f"audio input {i}: " if len(sources) > 1 else ""
            raise AudioError(f"{where}{e}") from e
    return waveforms


def window_output(output: Any, what: str, length_penalty: float | None = None) -> WindowOutput:
    """A finished RequestOutput -> WindowOutput (of n > 1 samples, the best ranked, as
    openai-whisper's best_of); TranscriptionError when the engine failed it."""
    if output is None:
        raise TranscriptionError(f"{what}: the request ended without an output")
    if getattr(output, "error", None) is not None:
        raise TranscriptionError(f"{what}: {output.error}")
    candidates = []
    for completion in output.outputs:
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                entry[token].logprob
                for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
        candidates.append((list(completion.token_ids), logprobs))
    extras = getattr(output, "extras", None) or {}
    token_ids, logprobs = max(candidates, key=lambda c: _rank(c[1], length_penalty))
    token_times = extras.get(TOKEN_TIMES) if len(candidates) == 1 else None
    return WindowOutput(
        token_ids,
        logprobs,
        extras.get(NO_SPEECH_PROB),
        list(token_times) if token_times is not None else None,
    )


def _rank(logprobs: list[float] | None, length_penalty: float | None) -> float:
    """openai-whisper's MaximumLikelihoodRanker score of one sample."""
    if not logprobs:
        return float("-inf")
    length = len(logprobs)
    penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
    return math.fsum(logprobs) / penalty


def beam_window_output(search: BeamSearch) -> WindowOutput:
    """The best beam of a finished window beam search."""
    best = search.result()[0]
    return WindowOutput(best.token_ids, best.logprobs, search.first_extras.get(NO_SPEECH_PROB))


class ProgressBar:
    """A tqdm bar over seconds of audio with the real-time factor (audio s / wall s)."""

    def __init__(self, progress: list[FileProgress], enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.progress = progress
        self.start = time.perf_counter()
        self.shown = 0.0
        total = sum(p.duration for p in progress)
        self.bar = tqdm(
            total=round(total, 1),
            desc="Transcribing",
            unit="s",
            unit_scale=False,
            bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s audio [{elapsed}<{remaining}{postfix}]",
            dynamic_ncols=True,
            disable=not enabled,
        )

    def refresh(self) -> None:
        done = round(sum(p.done for p in self.progress), 1)
        if done <= self.shown:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"RTFx {done / elapsed:.1f}", refresh=False)
        self.bar.update(done - self.shown)
        self.shown = done

    def close(self) -> None:
        self.bar.close()


def show_progress(use_tqdm: bool, progress: list[FileProgress]) -> bool:
    """Bars are for batches and for audio longer than one window."""
    return use_tqdm and (len(progress) > 1 or any(p.duration > WINDOW_SECONDS for p in progress))


class Transcriber:
    """Transcription over a synchronous engine (`LLMEngine`: add_request, step, abort_request)."""

    def __init__(self, engine: Any, max_active_files: int | None = None) -> None:
        """`max_active_files`: files decoded at once (default: twice the engine's max_num_seqs;
        each has one window in flight)."""
        self.engine = engine
        self.builder = WhisperInputBuilder(engine.model_config, engine.tokenizer)
        if max_active_files is None:
            config = getattr(engine, "config", None)
            max_num_seqs = config.scheduler_config.max_num_seqs if config is not None else 128
            max_active_files = 2 * max_num_seqs
        self.max_active_files = max(1, max_active_files)

    def transcribe(
        self, audio: Any, *, use_tqdm: bool = False, **options: Any
    ) -> list[TranscriptionResult]:
        """One result per input, in order; `options` are `TranscriptionOptions` fields.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. Files advance
        window by window (each window depends on the one before); the windows of many files
        run in the same engine steps. Raises ValueError (AudioError for audio) on bad input
        before anything runs, and TranscriptionError if the engine fails a request."""
        planner = TranscriptionPlanner(
            self.builder,
            TranscriptionOptions.from_kwargs(options),
            f"transcribe-{uuid.uuid4().hex}",
        )
        waveforms = load_audio_inputs(audio)
        progress = [FileProgress(w.shape[0] / SAMPLE_RATE) for w in waveforms]
        plans = [
            planner.plan(i, w, p) for i, (w, p) in enumerate(zip(waveforms, progress, strict=True))
        ]
        bar = ProgressBar(progress, show_progress(use_tqdm, progress))
        try:
            return self._run(plans, bar.refresh)
        finally:
            bar.close()

    def _run(self, plans: list[Plan], on_progress: Callable[[], None]) -> list[TranscriptionResult]:
        engine = self.engine
        pending: dict[str, tuple[int, int, float | None]] = {}
        """req_id -> (plan index, position in the plan's current batch, best_of ranking)."""
        beams: dict[str, tuple[BeamSearch, int, int, list]] = {}
        """Window beam searches: req_id -> (search, plan index, position, step keys)."""
        batches: list[list[WindowOutput | None]] = [[] for _ in plans]
        results: list[TranscriptionResult | None] = [None] * len(plans)
        waiting = deque(range(len(plans)))
        active: set[int] = set()

        def advance(i: int, sent: list[WindowOutput] | None) -> None:
            try:
                batch = plans[i].send(sent)  # type: ignore[arg-type]
            except StopIteration as stop:
                results[i] = stop.value
                active.discard(i)
                return
            batches[i] = [None] * len(batch)
            for j, request in enumerate(batch):
                if request.beam is not None:
                    search = make_beam_search(
                        engine, request.request_id, request.prompt, request.beam, request.params
                    )
                    beams[request.request_id] = (search, i, j, [])
                    step_beam(request.request_id)
                    continue
                engine.add_request(request.request_id, request.prompt, request.params)
                pending[request.request_id] = (i, j, request.length_penalty)

        def deliver(i: int, j: int, output: WindowOutput) -> None:
            batches[i][j] = output
            if all(out is not None for out in batches[i]):
                advance(i, batches[i])  # type: ignore[arg-type]

        def step_beam(req_id: str) -> None:
            """Feeds a window's beam search its last step's outputs once all are in, then
            queues its next step (or delivers its best beam)."""
            if req_id not in beams:
                return
            search, i, j, keys = beams[req_id]
            if keys:
                step_ids = [key[2] for key in keys]
                if not engine.core_outputs_ready(step_ids):
                    return
                outputs = {r: engine.take_core_output(r) for r in step_ids}
                advance_beam_searches([search], keys, outputs)
            while not search.done:
                step = beam_step_requests([search])
                if step.requests:
                    beams[req_id] = (search, i, j, step.keys)
                    engine.add_core_requests(step.requests)
                if step.release_ids:
                    engine.abort_core_requests(step.release_ids)  # parents nothing forks from
                if step.requests:
                    return
                advance_beam_searches([search], step.keys, {})  # a forced step: no engine work
            engine.abort_core_requests(take_step_request_ids([search]))  # the last step's KV
            del beams[req_id]
            deliver(i, j, beam_window_output(search))

        def start_waiting() -> None:
            while waiting and len(active) < self.max_active_files:
                i = waiting.popleft()
                active.add(i)
                advance(i, None)

        try:
            start_waiting()
            while pending or beams:
                for output in engine.step():
                    key = pending.get(output.request_id)
                    if key is None or not output.finished:
                        continue
                    del pending[output.request_id]
                    i, j, length_penalty = key
                    deliver(i, j, window_output(output, f"audio input {i}", length_penalty))
                for req_id in list(beams):
                    step_beam(req_id)
                start_waiting()
                on_progress()
        except BaseException:
            if pending:
                engine.abort_request(list(pending))
            # The last step of each search: in flight, or held for forks.
            in_flight = take_step_request_ids([search for search, *_ in beams.values()])
            if in_flight:
                engine.abort_core_requests(in_flight)
            raise
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


class AsyncTranscriber:
    """Transcription over `AsyncLLM.generate`: each input's plan runs as its own task."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.builder = WhisperInputBuilder(llm.model_config, llm.tokenizer)

    async def transcribe(
        self, audio: Any, *, request_id: str | None = None, **options: Any
    ) -> list[TranscriptionResult]:
        """As `Transcriber.transcribe`; `request_id` prefixes the ids of its requests."""
        prefix = request_id or f"transcribe-{uuid.uuid4().hex}"
        planner = TranscriptionPlanner(
            self.builder, TranscriptionOptions.from_kwargs(options), prefix
        )
        waveforms = load_audio_inputs(audio)
        plans = [planner.plan(i, w) for i, w in enumerate(waveforms)]
        return await _gather_or_cancel([self._run_plan(i, p) for i, p in enumerate(plans)])

    async def _run_plan(self, index: int, plan: Plan) -> TranscriptionResult:
        sent: list[WindowOutput] | None = None
        while True:
            try:
                batch = plan.send(sent)  # type: ignore[arg-type]
            except StopIteration as stop:
                return stop.value
            sent = await _gather_or_cancel([self._run_request(index, r) for r in batch])

    async def _run_request(self, index: int, request: WindowRequest) -> WindowOutput:
        if request.beam is not None:
            search = await self.llm.run_input_work(
                make_beam_search,
                self.llm,
                request.request_id,
                request.prompt,
                request.beam,
                request.params,
            )
            await run_beam_search_async(
                [search], self.llm.run_core_requests_async, self.llm.release_core_requests
            )
            return beam_window_output(search)
        final = None
        async for output in self.llm.generate(request.prompt, request.params, request.request_id):
            final = output
        return window_output(final, f"audio input {index}", request.length_penalty)


async def _gather_or_cancel(coros: list[Awaitable[_T]]) -> list[_T]:
    """asyncio.gather that cancels the other tasks (aborting their requests) if one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
