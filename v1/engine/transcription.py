"""Whisper transcription over the engine: audio -> 30 s windows -> requests -> timed segments.

Each file's plan (language detection, window requests, previous-text conditioning, segment
assembly) is a generator shared by two drivers: `Transcriber` over the synchronous `LLMEngine`
(add_request / step) and `AsyncTranscriber` over `AsyncLLM.generate`. A driver only runs the
batches of requests a plan yields and sends back their outputs, so windows of all files batch.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Awaitable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from v1.audio import (
    MIN_AUDIO_SECONDS,
    SAMPLE_RATE,
    AudioError,
    AudioWindow,
    Segment,
    load_audio,
    split_windows,
    timestamp_segments,
)
from v1.engine.whisper_inputs import WINDOW_SECONDS, WhisperInputBuilder
from v1.sampling_params import SamplingParams

NO_SPEECH_PROB = "no_speech_prob"
_T = TypeVar("_T")


class TranscriptionError(RuntimeError):
    """The engine failed a transcription request (the message names the input and window)."""


@dataclass
class TranscriptionSegment:
    """Text between two times, in seconds from the start of the audio. avg_logprob,
    compression_ratio and no_speech_prob describe the 30 s window the segment comes from."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    """Text token ids (no special or timestamp tokens)."""
    avg_logprob: float
    """Mean raw logprob of the window's sampled tokens (EOS included, as openai-whisper)."""
    compression_ratio: float
    """len(text bytes) / len(zlib-compressed text bytes) of the window's text."""
    no_speech_prob: float | None
    """P(<|nospeech|>) at <|startoftranscript|>; None when the frontend does not carry it."""


@dataclass
class TranscriptionResult:
    text: str
    language: str
    """ISO 639-1 code (detected when not given)."""
    duration: float
    """Seconds of audio."""
    segments: list[TranscriptionSegment] = field(default_factory=list)


@dataclass(frozen=True)
class WindowRequest:
    """One request a plan asks a driver to run."""

    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams


@dataclass(frozen=True)
class WindowOutput:
    """What a plan needs back from one finished request."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Raw logprob of each sampled token (requests ask for logprobs=0)."""
    no_speech_prob: float | None


Plan = Generator[list[WindowRequest], list[WindowOutput], TranscriptionResult]


@dataclass(frozen=True)
class TranscriptionOptions:
    language: str | None = None
    task: str = "transcribe"
    timestamps: bool = False
    prompt: str | None = None
    sampling_params: SamplingParams | None = None
    condition_on_previous_text: bool = False


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
        self.prompt_ids = builder.text_prompt_ids(options.prompt) if options.prompt else []
        self.params = self._window_params(options.sampling_params, options.timestamps)

    @staticmethod
    def _window_params(params: SamplingParams | None, timestamps: bool) -> SamplingParams:
        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=None)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(
                f"transcription samples one sequence per window (n=1), got n={params.n}"
            )
        logprobs = 0 if params.logprobs is None else params.logprobs
        return params.clone(whisper_timestamps=timestamps, logprobs=logprobs)

    # ---- the plan of one file ----
    def plan(self, index: int, samples: np.ndarray) -> Plan:
        windows = [
            w
            for w in split_windows(samples, SAMPLE_RATE, WINDOW_SECONDS)
            if w.duration_seconds >= MIN_AUDIO_SECONDS
        ]
        language = self.language
        if language is None and self.tokens.multilingual:
            (detected,) = yield [self._detect_request(index, windows[0])]
            language = self._language_of(detected)
        language = language or "en"
        outputs: list[WindowOutput] = []
        if self.options.condition_on_previous_text:
            history = list(self.prompt_ids)
            for k, window in enumerate(windows):
                (out,) = yield [self._window_request(index, k, window, language, history)]
                outputs.append(out)
                history += self._text_ids(out.token_ids)
        else:
            outputs = yield [
                self._window_request(index, k, w, language, self.prompt_ids if k == 0 else [])
                for k, w in enumerate(windows)
            ]
        return self._assemble(samples, windows, outputs, language)

    def _detect_request(self, index: int, window: AudioWindow) -> WindowRequest:
        """One decoder step over the language tokens; it shares the window's encoder output
        (same content hash) with the transcription request that follows."""
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            allowed_token_ids=sorted(self.tokens.language_ids.values()),
        )
        prompt = {"prompt_token_ids": [self.tokens.sot], "multi_modal_data": _audio(window)}
        return WindowRequest(f"{self.prefix}-{index}-language", prompt, params)

    def _language_of(self, output: WindowOutput) -> str:
        token_id = output.token_ids[0] if output.token_ids else None
        code = self.tokens.language_of_id.get(token_id) if token_id is not None else None
        if code is None:
            raise TranscriptionError(f"language detection returned token {token_id}, no language")
        return code

    def _window_request(
        self, index: int, k: int, window: AudioWindow, language: str, previous: list[int]
    ) -> WindowRequest:
        ids = self.builder.decoder_prompt(
            language=language,
            task=self.options.task,
            timestamps=self.options.timestamps,
            previous_text_ids=previous,
        )
        prompt = {"prompt_token_ids": ids, "multi_modal_data": _audio(window)}
        return WindowRequest(f"{self.prefix}-{index}-{k}", prompt, self.params)

    # ---- results ----
    def _text_ids(self, token_ids: Sequence[int]) -> list[int]:
        return [t for t in _until_eos(token_ids, self.tokens.eos) if t < self.tokens.eos]

    def _assemble(
        self,
        samples: np.ndarray,
        windows: list[AudioWindow],
        outputs: list[WindowOutput],
        language: str,
    ) -> TranscriptionResult:
        decode = self.builder.tokenizer.decode
        segments: list[TranscriptionSegment] = []
        all_text_ids: list[int] = []
        last_end = 0.0
        for window, out in zip(windows, outputs, strict=True):
            content = _until_eos(out.token_ids, self.tokens.eos)
            text_ids = self._text_ids(content)
            all_text_ids += text_ids
            stats = _window_stats(decode(text_ids), out, len(content))
            window_end = window.offset_seconds + window.duration_seconds
            for seg in self._window_segments(window, content):
                ids = [t for t in seg.token_ids if t < self.tokens.eos]
                if not ids:
                    continue
                start = min(max(seg.start, last_end), window_end)
                end = min(max(seg.end, start), window_end)
                segments.append(
                    TranscriptionSegment(
                        id=len(segments),
                        start=round(start, 3),
                        end=round(end, 3),
                        text=decode(ids),
                        tokens=ids,
                        **stats,
                    )
                )
                last_end = end
        return TranscriptionResult(
            text=decode(all_text_ids),
            language=language,
            duration=samples.shape[0] / SAMPLE_RATE,
            segments=segments,
        )

    def _window_segments(self, window: AudioWindow, content: list[int]) -> list[Segment]:
        if self.options.timestamps:
            return timestamp_segments(
                content,
                timestamp_begin=self.tokens.timestamp_begin,
                offset_seconds=window.offset_seconds,
                window_seconds=window.duration_seconds,
            )
        start = window.offset_seconds
        return [Segment(start, start + window.duration_seconds, list(content))]


def _audio(window: AudioWindow) -> dict[str, Any]:
    # The window's clip: its requests (language detection, transcription) share one hash.
    return {"audio": window.clip}


def _until_eos(token_ids: Sequence[int], eos: int) -> list[int]:
    ids = list(token_ids)
    return ids[: ids.index(eos)] if eos in ids else ids


def _window_stats(text: str, out: WindowOutput, num_content_tokens: int) -> dict[str, Any]:
    avg_logprob = float("nan")
    if out.logprobs:
        avg_logprob = sum(out.logprobs) / (num_content_tokens + 1)
    return {
        "avg_logprob": avg_logprob,
        "compression_ratio": compression_ratio(text),
        "no_speech_prob": out.no_speech_prob,
    }


def compression_ratio(text: str) -> float:
    """openai-whisper's gzip-style repetition measure: raw bytes / zlib-compressed bytes."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


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


def window_output(output: Any, what: str) -> WindowOutput:
    """A finished RequestOutput -> WindowOutput; TranscriptionError when the engine failed it."""
    if output is None:
        raise TranscriptionError(f"{what}: the request ended without an output")
    if getattr(output, "error", None) is not None:
        raise TranscriptionError(f"{what}: {output.error}")
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [
            entry[token].logprob
            for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
    extras = getattr(output, "extras", None) or {}
    return WindowOutput(list(completion.token_ids), logprobs, extras.get(NO_SPEECH_PROB))


class Transcriber:
    """Transcription over a synchronous engine (`LLMEngine`: add_request, step, abort_request)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.builder = WhisperInputBuilder(engine.model_config, engine.tokenizer)

    def transcribe(
        self,
        audio: Any,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        condition_on_previous_text: bool = False,
    ) -> list[TranscriptionResult]:
        """One result per input, in order. Windows of every input run batched (sequentially per
        input with `condition_on_previous_text`, each prompted with the text so far); without
        a language, one decoder step over the language tokens picks it from the first window.

        `audio`: a path, bytes, `(samples, sample_rate)` or a list of them. `prompt`: previous
        text for the first window. `sampling_params`: per window (default greedy with no token
        cap; its max_tokens caps every window, logprobs is raised to 0 for avg_logprob).
        Raises ValueError (AudioError for audio) on bad input before anything runs, and
        TranscriptionError if the engine fails a request."""
        options = TranscriptionOptions(
            language, task, timestamps, prompt, sampling_params, condition_on_previous_text
        )
        planner = TranscriptionPlanner(self.builder, options, f"transcribe-{uuid.uuid4().hex}")
        waveforms = load_audio_inputs(audio)
        return self._run([planner.plan(i, w) for i, w in enumerate(waveforms)])

    def _run(self, plans: list[Plan]) -> list[TranscriptionResult]:
        engine = self.engine
        pending: dict[str, tuple[int, int]] = {}
        """req_id -> (plan index, position in the plan's current batch)."""
        batches: list[list[WindowOutput | None]] = [[] for _ in plans]
        results: list[TranscriptionResult | None] = [None] * len(plans)

        def advance(i: int, sent: list[WindowOutput] | None) -> None:
            try:
                batch = plans[i].send(sent)  # type: ignore[arg-type]
            except StopIteration as stop:
                results[i] = stop.value
                return
            batches[i] = [None] * len(batch)
            for j, request in enumerate(batch):
                engine.add_request(request.request_id, request.prompt, request.params)
                pending[request.request_id] = (i, j)

        try:
            for i in range(len(plans)):
                advance(i, None)
            while pending:
                for output in engine.step():
                    key = pending.get(output.request_id)
                    if key is None or not output.finished:
                        continue
                    del pending[output.request_id]
                    i, j = key
                    batches[i][j] = window_output(output, f"audio input {i}")
                    if all(out is not None for out in batches[i]):
                        advance(i, batches[i])  # type: ignore[arg-type]
        except BaseException:
            if pending:
                engine.abort_request(list(pending))
            raise
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


class AsyncTranscriber:
    """Transcription over `AsyncLLM.generate`: each input's plan runs as its own task."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.builder = WhisperInputBuilder(llm.model_config, llm.tokenizer)

    async def transcribe(
        self,
        audio: Any,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        condition_on_previous_text: bool = False,
        request_id: str | None = None,
    ) -> list[TranscriptionResult]:
        """As `Transcriber.transcribe`; `request_id` prefixes the ids of its requests."""
        options = TranscriptionOptions(
            language, task, timestamps, prompt, sampling_params, condition_on_previous_text
        )
        prefix = request_id or f"transcribe-{uuid.uuid4().hex}"
        planner = TranscriptionPlanner(self.builder, options, prefix)
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
        final = None
        async for output in self.llm.generate(request.prompt, request.params, request.request_id):
            final = output
        return window_output(final, f"audio input {index}")


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
