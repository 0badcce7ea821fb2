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
from typing import Any

import numpy as np

from v1.audio import SAMPLE_RATE, AudioClip
from v1.audio.vad import SpeechMap, collect_speech, get_speech_timestamps
from v1.core.protocol import EngineCoreRequest, now
from v1.engine.beam_search import BeamSearchParams
from v1.engine.inputs.whisper import WhisperInputBuilder, WhisperInputError
from v1.engine.output_processor import ParentRequest
from v1.engine.transcription.hallucination import Span, WindowPlace, skip_hallucinations
from v1.engine.transcription.options import TranscriptionOptions
from v1.engine.transcription.plan_io import FileProgress, Plan, WindowOutput, WindowRequest
from v1.engine.transcription.seek import (
    FRAMES_PER_SECOND,
    MAX_CONDITIONING_TEMPERATURE,
    SAMPLES_PER_FRAME,
    WINDOW_FRAMES,
    DecodeQuality,
    Verdict,
    average_logprob,
    compression_ratio,
    seek_window,
)
from v1.engine.transcription.segments import (
    Attempt,
    DecodedWindow,
    SegmentAssembler,
    TranscriptionError,
    TranscriptionResult,
)
from v1.engine.transcription.window_params import window_params
from v1.engine.transcription.words import span_words
from v1.sampling_params import SamplingParams

WINDOW_SAMPLES = WINDOW_FRAMES * SAMPLES_PER_FRAME


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
        lora_request: Any = None,
    ) -> None:
        """`stream_text`: windows run with the engine's detokenizer on, so that a driver can
        pass their text on as it is decoded (otherwise only stop strings need it).
        `lora_request`: the LoRA adapter (checked by the caller) every request of every plan
        runs with: windows, language detection, alignment, each beam (None: the base model)."""
        self.builder = builder
        self.lora_request = lora_request
        self.stream_text = stream_text
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
        self.params = window_params(builder, options, stream_text)
        self.fallback = options.fallback(self.params)
        keep = builder.max_prompt_text_tokens
        self.prefix_ids = builder.text_prompt_ids(options.prefix)[:keep] if options.prefix else []
        self.hotword_ids = (
            builder.text_prompt_ids(options.hotwords)[:keep] if options.hotwords else []
        )

    def continued(self, language: str, request_prefix: str) -> TranscriptionPlanner:
        """This planner for audio that follows audio it transcribed (the server's next chunk):
        in `language` (an ISO code a plan returned), without the prompt text (it preceded the
        earlier audio), request ids under `request_prefix`. Nothing is checked again."""
        assert not self.tokens.multilingual or language in self.tokens.language_ids, language
        following = copy.copy(self)
        following.language = language
        following.prompt_ids = []
        following.prefix_ids = []  # the prefix starts the file, not each chunk
        following.prefix = request_prefix
        return following

    def clipped(self, start: float, end: float) -> TranscriptionPlanner | None:
        """This planner for the part of the recording from `start` to `end` seconds (the
        server's chunk of a long upload): clip_timestamps' spans that reach into it, on its
        own clock; None when none does (nothing of it is decoded). Itself without spans."""
        stamps = list(self.options.clip_timestamps)
        if not stamps:
            return self
        if len(stamps) % 2:
            stamps.append(math.inf)  # a last start runs to the end of the recording
        spans: list[float] = []
        for a, b in zip(stamps[::2], stamps[1::2], strict=True):
            a, b = max(a, start), min(b, end)
            if b > a:
                spans += [round(a - start, 3), round(b - start, 3)]
        if not spans:
            return None
        part = copy.copy(self)
        part.options = dataclasses.replace(self.options, clip_timestamps=tuple(spans))
        return part

    def for_chunks(self, language: str | None) -> TranscriptionPlanner:
        """This planner for the chunks of a batched file (batch_size): each chunk (<= 30 s) is
        decoded on its own, in `language` (None: each chunk detects its own), with the prompt
        and hotwords; no VAD or clip spans inside a chunk (the chunks come from them). As
        faster-whisper's batched pipeline, a chunk is one `<|notimestamps|>` segment unless
        timestamps=True (timed segments inside it)."""
        chunked = copy.copy(self)
        chunked.options = dataclasses.replace(
            self.options,
            vad_filter=False,
            clip_timestamps=(),
            batch_size=None,
            timestamps=self.options.timestamps and not self.options.without_timestamps,
        )
        if language is not None:
            chunked.language = language
        return chunked

    def detect_plan(self, index: int, samples: np.ndarray) -> Plan:
        """Language detection alone on the first 30 s of `samples`: returns (code, probability)
        as the plan's result (a batched file detects once, before its chunks)."""
        clip = AudioClip(samples[:WINDOW_SAMPLES])
        detected = yield self._detect_request(index, clip, "batch")
        return self._language_of(detected)  # type: ignore[return-value]

    # ---- the plan of one file ----
    def plan(self, index: int, samples: np.ndarray, progress: FileProgress | None = None) -> Plan:
        """The requests of one file (16 kHz float32 samples, as `load_audio` returns them),
        window after window; returns its result. Audio that fits one window without timestamps
        is one `<|notimestamps|>` request (transformers' short-form); anything else seeks on
        timestamps (openai-whisper's long-form)."""
        progress = progress or FileProgress(samples.shape[0] / SAMPLE_RATE)
        options = self.options
        original_duration = samples.shape[0] / SAMPLE_RATE
        speech_map = None
        if options.vad_filter:
            spans = get_speech_timestamps(samples, options.vad_parameters)
            samples = collect_speech(samples, spans)
            speech_map = SpeechMap(spans)
            if samples.shape[0] == 0:
                progress.done = progress.duration
                return TranscriptionResult(
                    text="",
                    language=self.language or "en",
                    duration=original_duration,
                    segments=[],
                    words=[] if options.word_timestamps else None,
                    language_probability=1.0 if self.language else None,
                )
        short_form = (
            not options.timestamps
            and samples.shape[0] <= WINDOW_SAMPLES
            and not options.clip_timestamps
            and not options.vad_filter  # speech spans joined: segments find the gaps
        )
        num_frames = samples.shape[0] // SAMPLES_PER_FRAME
        first = AudioClip(
            samples if short_form else samples[: min(num_frames, WINDOW_FRAMES) * SAMPLES_PER_FRAME]
        )
        language, probability = self.language, 1.0
        detect = self.tokens.multilingual and (language is None or options.multilingual)
        if detect and not options.clip_timestamps:
            detected = yield self._detect_request(index, first)
            language, probability = self._language_of(detected)
        language = language or "en"
        assembler = SegmentAssembler(
            self.builder.tokenizer.decode,
            self.tokens.eos,
            samples.shape[0] / SAMPLE_RATE,
            self.options.word_timestamps,
            speech_map,
            progress.on_segment,
        )
        if short_form:
            attempt = yield from self._decode(
                index, "0", first, language, self.prompt_ids, False, self.prefix_ids
            )
            text_ids = [t for t in attempt.content if t < self.tokens.eos]
            duration = samples.shape[0] / SAMPLE_RATE
            spans = [] if attempt.verdict is Verdict.SKIP else [(0.0, duration, text_ids)]
            assembler.add(DecodedWindow(0, spans, attempt, language))
        else:
            language, probability = yield from self._seek_windows(
                index, samples, first, language, probability, progress, detect, assembler
            )
        progress.done = progress.duration
        result = assembler.result(language)
        result.language_probability = probability if detect else 1.0
        if speech_map is not None:
            result.duration = original_duration
        return result

    def _seek_clips(self, num_frames: int) -> list[tuple[int, int]]:
        """(start, end) frames to decode: the whole audio, or clip_timestamps' spans."""
        stamps = self.options.clip_timestamps
        if not stamps:
            return [(0, num_frames)]
        points = [round(t * FRAMES_PER_SECOND) for t in stamps]
        if len(points) % 2:
            points.append(num_frames)
        clips = []
        for start, end in zip(points[::2], points[1::2], strict=True):
            start, end = min(start, num_frames), min(end, num_frames)
            if end > start:
                clips.append((start, end))
        return clips

    def _seek_windows(
        self,
        index: int,
        samples: np.ndarray,
        first: AudioClip,
        language: str,
        probability: float,
        progress: FileProgress,
        detect: bool,
        assembler: SegmentAssembler,
    ) -> Generator[WindowRequest, WindowOutput, tuple[str, float]]:
        """Windows from `seek` (frames): each starts where the previous one's last complete
        segment ended, or at its end when it ended on a complete segment or was silence. Each
        decoded window goes to `assembler` at once. Returns the (first detected) language with
        its probability."""
        num_frames = samples.shape[0] // SAMPLES_PER_FRAME
        first_frames = min(num_frames, WINDOW_FRAMES)
        history = list(self.prompt_ids)
        timestamps = not self.options.without_timestamps
        seek = 0
        file_language: str | None = None
        for clip_start, clip_end in self._seek_clips(num_frames):
            seek = max(seek, clip_start)
            while seek < clip_end:
                size = min(clip_end - seek, WINDOW_FRAMES)
                audio = (
                    first
                    if seek == 0 and size == first_frames
                    else AudioClip(
                        samples[seek * SAMPLES_PER_FRAME : (seek + size) * SAMPLES_PER_FRAME]
                    )
                )
                label = str(len(assembler.windows))
                if (
                    detect
                    and (assembler.windows or self.options.clip_timestamps)
                    and (self.options.multilingual or file_language is None)
                ):
                    detected = yield self._detect_request(index, audio, label)
                    language, window_probability = self._language_of(detected)
                    if file_language is None:
                        probability = window_probability
                file_language = file_language or language
                # faster-whisper: the prefix is forced in the window at seek 0 only, with the
                # timestamps on (the sampler frees the first token after it).
                prefix = self.prefix_ids if seek == 0 else []
                attempt = yield from self._decode(
                    index, label, audio, language, history, timestamps, prefix
                )
                place = WindowPlace(seek, size, num_frames)
                seek, history = self._take_window(attempt, place, language, history, assembler)
                progress.done = min(seek, num_frames) * SAMPLES_PER_FRAME / SAMPLE_RATE
        return file_language or language, probability

    def _take_window(
        self,
        attempt: Attempt,
        place: WindowPlace,
        language: str,
        history: list[int],
        assembler: SegmentAssembler,
    ) -> tuple[int, list[int]]:
        """Cut a decoded window into its segments and hand them to `assembler`; returns where
        the next window starts (frames) and the prompt history it gets."""
        seek, size = place.seek, place.size
        if attempt.verdict is Verdict.SKIP:
            assembler.add(DecodedWindow(seek, [], attempt, language))
            return seek + size, history
        segments, next_seek = seek_window(
            attempt.content,
            seek=seek,
            num_frames=size,
            timestamp_begin=self.tokens.timestamp_begin,
        )
        spans = [
            (s.start, s.end, [t for t in s.token_ids if t < self.tokens.eos]) for s in segments
        ]
        last_word_end = None
        kept = segments
        if self.options.hallucination_silence_threshold is not None:
            spans, next_seek, last_word_end, again = self._skip_hallucinations(
                spans, attempt, place, next_seek, language, assembler.windows
            )
            if again:
                # A hallucination after a long silence: decoded again from after the silence;
                # the prompt stays as it was (faster-whisper's `continue`).
                assembler.add(DecodedWindow(seek, [], attempt, language))
                return next_seek, history
            kept = segments[: len(spans)]  # dropped segments do not prompt the next
        assembler.add(DecodedWindow(seek, spans, attempt, language, last_word_end))
        conditioned = attempt.temperature <= MAX_CONDITIONING_TEMPERATURE
        if not (self.options.condition_on_previous_text and conditioned):
            return next_seek, []
        history = history + [t for s in kept for t in s.token_ids]
        return next_seek, history[-self.builder.max_prompt_text_tokens :]  # all a prompt keeps

    def _decode(
        self,
        index: int,
        label: str,
        audio: AudioClip,
        language: str,
        previous: list[int],
        timestamps: bool,
        prefix: list[int] | None = None,
    ) -> Generator[WindowRequest, WindowOutput, Attempt]:
        """One window at each fallback temperature until the verdict is not RETRY; then, for
        word timestamps of a beam or a best-of sample, the alignment pass of the kept tokens."""
        attempt = yield from self._decode_fallback(
            index, label, audio, language, previous, timestamps, prefix or []
        )
        text = [t for t in attempt.content if t < self.tokens.eos]
        if self.options.word_timestamps and attempt.token_times is None and text:
            ids = [*self._decoder_prompt(language, False, []), *text]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=1,
                allowed_token_ids=[self.tokens.eos],
                suppress_tokens=[],
                begin_suppress_tokens=[],
                word_timestamps=True,
                detokenize=False,
            )
            out = yield self._window(f"{self.prefix}-{index}-{label}-align", ids, audio, params)
            attempt = dataclasses.replace(attempt, token_times=out.token_times)
        return attempt

    def _decode_fallback(
        self,
        index: int,
        label: str,
        audio: AudioClip,
        language: str,
        previous: list[int],
        timestamps: bool,
        prefix: list[int],
    ) -> Generator[WindowRequest, WindowOutput, Attempt]:
        fallback = self.fallback
        ids = self._decoder_prompt(language, timestamps, previous, prefix)
        options = self.options
        window_params = self.params
        begin = window_params.begin_suppress_tokens
        if prefix and timestamps and begin:
            # max_initial_timestamp bounds the first timestamp of a window; after a prefix
            # the window's first timestamp is the forced <|0.00|> (CTranslate2 lifts it too).
            tb = self.tokens.timestamp_begin
            window_params = window_params.clone(begin_suppress_tokens=[t for t in begin if t < tb])
        for k, temperature in enumerate(fallback.temperatures):
            params = window_params.clone(temperature=temperature, whisper_timestamps=timestamps)
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
            attempt = self._judge(out, temperature, prefix, timestamps)
            if attempt.verdict is not Verdict.RETRY or fallback.is_last(k):
                if attempt.verdict is Verdict.RETRY:
                    attempt = dataclasses.replace(attempt, verdict=Verdict.ACCEPT)
                return attempt
        raise AssertionError("a fallback has at least one temperature")

    def _judge(
        self,
        out: WindowOutput,
        temperature: float,
        prefix: list[int] | None = None,
        timestamps: bool = False,
    ) -> Attempt:
        eos = self.tokens.eos
        content = _until_eos(out.token_ids, eos)
        decoded = out.token_ids[: len(content) + 1]  # EOS counts, when there is one
        logprobs = out.logprobs[: len(decoded)] if out.logprobs else None
        if logprobs and len(logprobs) >= len(content):
            probs = [math.exp(lp) for t, lp in zip(content, logprobs, strict=False) if t < eos]
        else:
            probs = [float("nan")] * sum(t < eos for t in content)
        # The prefix is part of the prompt, forced: the window's text starts with it.
        forced = ([self.tokens.timestamp_begin] if timestamps else []) + list(prefix or [])
        if prefix:
            content = forced + content
            probs = [1.0] * len(prefix) + probs
            # As faster-whisper's avg_logprob and compression ratio: the window's tokens are
            # `[<|0.00|>] prefix` and the sampled ones, the forced ones with logprob 0
            # (CTranslate2 scores them so).
            decoded = forced + decoded
            if logprobs:
                logprobs = [0.0] * len(forced) + logprobs
        quality = DecodeQuality(
            compression_ratio(decoded, self.builder.model_config.vocab_size),
            average_logprob(logprobs),
            out.no_speech_prob,
        )
        verdict = self.fallback.verdict(quality)
        return Attempt(content, quality, temperature, verdict, out.token_times, probs)

    def _detect_request(self, index: int, audio: AudioClip, label: str = "") -> WindowRequest:
        """One decoder step over the language tokens; it shares the window's encoder output
        (same samples, same content hash) with the transcription request after it."""
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            logprobs=0,
            allowed_token_ids=sorted(self.tokens.language_ids.values()),
        )
        suffix = f"-{label}" if label else ""
        return self._window(
            f"{self.prefix}-{index}-language{suffix}", [self.tokens.sot], audio, params
        )

    def _language_of(self, output: WindowOutput) -> tuple[str, float]:
        """(ISO code, probability) of a detection request's token."""
        token_id = output.token_ids[0] if output.token_ids else None
        code = self.tokens.language_of_id.get(token_id) if token_id is not None else None
        if code is None:
            raise TranscriptionError(f"language detection returned token {token_id}, no language")
        probability = math.exp(output.logprobs[0]) if output.logprobs else float("nan")
        return code, round(probability, 6)

    def _skip_hallucinations(
        self,
        spans: list[Span],
        attempt: Attempt,
        place: WindowPlace,
        next_seek: int,
        language: str,
        windows: list[DecodedWindow],
    ) -> tuple[list[Span], int, float | None, bool]:
        """hallucination_silence_threshold on one window (`skip_hallucinations`): (kept spans,
        next seek, end of the last kept word, whether the window is decoded again)."""
        threshold = self.options.hallucination_silence_threshold
        assert threshold is not None
        if not attempt.token_times:
            return spans, next_seek, None, False
        seg_words = span_words(
            [text_ids for _, _, text_ids in spans],
            attempt.token_times,
            attempt.text_probs,
            place.seek / FRAMES_PER_SECOND,
            self.builder.tokenizer.decode,
            language,
            self.tokens.eos,
        )
        # The end of the last word decoded so far (faster-whisper's last_speech_timestamp).
        last_speech = next(
            (w.last_word_end for w in reversed(windows) if w.last_word_end is not None), 0.0
        )
        content, tb = attempt.content, self.tokens.timestamp_begin
        return skip_hallucinations(
            spans,
            seg_words,
            place,
            next_seek,
            threshold=threshold,
            last_speech=last_speech,
            single_ending=len(content) >= 2 and content[-2] < tb <= content[-1],
        )

    # ---- engine requests ----
    def _decoder_prompt(
        self,
        language: str,
        timestamps: bool,
        previous: list[int],
        prefix: list[int] | None = None,
    ) -> list[int]:
        """`<|startofprev|> hotwords previous` `<|startoftranscript|><|lang|><|task|>`
        `[<|notimestamps|>]` then, at the first window, `[<|0.00|>] prefix` (faster-whisper's
        `get_prompt`: no hotwords in a window with a prefix), from the checked language and
        task."""
        tokens = self.tokens
        ids: list[int] = []
        hotwords = self.hotword_ids if not prefix else []
        if previous or hotwords:
            keep = max(0, self.builder.max_prompt_text_tokens - len(hotwords))
            ids = [tokens.prev, *hotwords, *(previous[-keep:] if keep else [])]
        ids.append(tokens.sot)
        if tokens.multilingual:
            ids += [tokens.language_ids[language], tokens.task_ids[self.task]]
        if not timestamps:
            ids.append(tokens.no_timestamps)
        if prefix:
            if timestamps:
                ids.append(tokens.timestamp_begin)
            ids += prefix
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
                lora_request=self.lora_request,
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


def _until_eos(token_ids: Sequence[int], eos: int) -> list[int]:
    ids = list(token_ids)
    return ids[: ids.index(eos)] if eos in ids else ids
