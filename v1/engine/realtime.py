"""Realtime transcription sessions over `AsyncLLM`: audio in while it is spoken, text out.

A `RealtimeSession` takes PCM16 chunks, resamples them to 16 kHz (soxr, streamed), cuts turns
(server VAD or an explicit `commit`), re-transcribes the turn being spoken every
`partial_interval_s` of new audio and passes on only the words two consecutive hypotheses agree on
(LocalAgreement-2: a delta is never retracted), then one completed transcript per turn: the
engine's transcription of the turn's audio, exactly as `LLM.transcribe` would give it. Sessions
submit their requests to the server's one engine, beside file transcriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from v1.audio import SAMPLE_RATE
from v1.engine.transcription import (
    AsyncTranscriber,
    InputDone,
    TranscriptionOptions,
    TranscriptionResult,
)
from v1.logger import init_logger

logger = init_logger(__name__)

SUPPORTED_INPUT_RATES = (16_000, 24_000)
"""PCM16 sample rates a session takes (24 kHz is OpenAI's `pcm16`)."""
SAMPLES_PER_MS = SAMPLE_RATE // 1000
MIN_TURN_SAMPLES = SAMPLE_RATE // 10
"""A commit of less audio than this (100 ms, as OpenAI) is an error, not a turn."""
END_PADDING_MS = 200
"""Silence kept after the last speech frame of a VAD turn (at most silence_duration_ms)."""
VAD_LOOKBACK_SAMPLES = 2 * 512
"""Samples the VAD may still place a speech start in (it reports starts one frame late)."""


class RealtimeError(ValueError):
    """A client event the session cannot take; `code` is OpenAI's error code for it."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class ServerVad:
    """Server-side turn detection (OpenAI's `server_vad`)."""

    threshold: float = 0.5
    """Speech probability above which a frame is speech (0-1)."""
    prefix_padding_ms: int = 300
    """Audio kept before the detected start of speech."""
    silence_duration_ms: int = 500
    """Silence after speech that ends the turn."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise RealtimeError(
                f"turn_detection.threshold must be in (0, 1), got {self.threshold}",
                "invalid_value",
                "turn_detection.threshold",
            )
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            value = getattr(self, name)
            if not 0 <= value <= 10_000:
                raise RealtimeError(
                    f"turn_detection.{name} must be in [0, 10000] ms, got {value}",
                    "invalid_value",
                    f"turn_detection.{name}",
                )


@dataclass(frozen=True)
class SessionConfig:
    """What a client may set with `session.update` / `transcription_session.update`."""

    input_sample_rate: int = 24_000
    """Sample rate of the PCM16 mono little-endian audio the client appends."""
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    """None: the client commits turns itself."""
    language: str | None = None
    """ISO code; None detects it per turn."""
    prompt: str | None = None
    """Text that precedes each turn (vocabulary, spelling)."""

    def __post_init__(self) -> None:
        if self.input_sample_rate not in SUPPORTED_INPUT_RATES:
            raise RealtimeError(
                f"input audio rate must be one of {list(SUPPORTED_INPUT_RATES)}, got "
                f"{self.input_sample_rate}",
                "invalid_value",
                "input_audio_format",
            )


@dataclass(frozen=True)
class SessionLimits:
    """Bounds every session of a server shares."""

    max_buffer_seconds: float = 300.0
    """Audio one uncommitted buffer (one turn) may hold; appending more is an error."""
    partial_interval_s: float = 1.0
    """New audio between two hypotheses of the turn being spoken (deltas); 0: no deltas."""


# ---- events a session emits (the endpoint turns them into OpenAI's JSON) ----
@dataclass(frozen=True)
class SpeechStarted:
    item_id: str
    audio_start_ms: int
    """From the start of the session's audio, prefix padding included."""


@dataclass(frozen=True)
class SpeechStopped:
    item_id: str
    audio_end_ms: int
    """From the start of the session's audio, the trailing silence included."""


@dataclass(frozen=True)
class Committed:
    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class Cleared:
    pass


@dataclass(frozen=True)
class TranscriptDelta:
    item_id: str
    delta: str


@dataclass(frozen=True)
class TranscriptCompleted:
    item_id: str
    transcript: str
    seconds: float
    """Audio of the turn."""


@dataclass(frozen=True)
class TranscriptFailed:
    item_id: str
    message: str


SessionEvent = (
    SpeechStarted
    | SpeechStopped
    | Committed
    | Cleared
    | TranscriptDelta
    | TranscriptCompleted
    | TranscriptFailed
)


@dataclass(frozen=True)
class TurnEvent:
    kind: str
    """"start" (of speech) or "end" (of a turn: speech, then silence_duration_ms of silence)."""
    sample: int
    """Session sample index (16 kHz): the first speech frame, or the end of the turn's audio."""


class TurnDetector:
    """Server VAD over the project's streaming Silero VAD (`v1.audio.vad.VadIterator`) in session
    sample positions: the session adds prefix padding itself and ends a turn END_PADDING_MS after
    its last speech frame."""

    def __init__(self, vad: ServerVad) -> None:
        from v1.audio.vad import VadIterator, VadOptions

        self.vad = VadIterator(
            VadOptions(
                threshold=vad.threshold,
                min_silence_duration_ms=vad.silence_duration_ms,
                speech_pad_ms=0,
            )
        )
        self.end_padding = min(END_PADDING_MS, vad.silence_duration_ms) * SAMPLES_PER_MS
        self.origin: int | None = None
        """Session sample of the VAD stream's first sample (None: nothing fed since reset)."""

    def feed(self, samples: np.ndarray, start: int) -> list[TurnEvent]:
        """Events completed by `samples`, which begin at session sample `start`."""
        if self.origin is None:
            self.origin = start
        events = []
        for event in self.vad.feed(samples):
            sample = self.origin + event.sample
            if event.kind == "end":
                sample += self.end_padding
            events.append(TurnEvent(event.kind, sample))
        return events

    def reset(self) -> None:
        self.vad.reset()
        self.origin = None

    def pending_start(self, end: int) -> int:
        """The earliest session sample a future speech start can still be placed at (`end`:
        the last sample fed)."""
        if self.origin is None:
            return end
        return self.origin + max(0, self.vad.samples_seen - VAD_LOOKBACK_SAMPLES)


# ---- LocalAgreement-2 ----
_WORD = re.compile(r"\s*\S+")


def split_words(text: str) -> list[str]:
    """Words with the whitespace before each, so that joining them gives the text back."""
    return _WORD.findall(text)


class LocalAgreement:
    """Stable prefix of a growing hypothesis: a word is passed on once two consecutive
    hypotheses agree on it and on every word before it. Emitted text is never taken back: a
    later pair that disagrees with it emits nothing until one agrees again."""

    def __init__(self) -> None:
        self.previous: list[str] | None = None
        self.emitted: list[str] = []

    def update(self, hypothesis: str) -> str:
        """The newly agreed text (possibly empty) after one more hypothesis."""
        words = split_words(hypothesis)
        previous, self.previous = self.previous, words
        if previous is None:
            return ""
        agreed: list[str] = []
        for a, b in zip(previous, words, strict=False):
            if a.strip() != b.strip():
                break
            agreed.append(b)
        n = len(self.emitted)
        if len(agreed) <= n or [w.strip() for w in agreed[:n]] != [w.strip() for w in self.emitted]:
            return ""
        new = agreed[n:]
        self.emitted += new
        return "".join(new)

    @property
    def text(self) -> str:
        return "".join(self.emitted)


class _AudioBuffer:
    """16 kHz samples from session sample `start` on, kept as the chunks they came in."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.start = 0
        self.end = 0

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self.chunks.append(samples)
            self.end += samples.size

    def slice(self, start: int, end: int) -> np.ndarray:
        """Samples [start, end) (session sample indices, clipped to what is held)."""
        whole = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        self.chunks = [whole] if whole.size else []
        return whole[max(start, self.start) - self.start : max(end, self.start) - self.start]

    def drop_before(self, sample: int) -> None:
        """Forget samples before `sample`."""
        sample = min(max(sample, self.start), self.end)
        if sample == self.start:
            return
        whole = self.slice(sample, self.end)
        self.chunks = [whole.copy()] if whole.size else []
        self.start = sample

    @property
    def num_samples(self) -> int:
        return self.end - self.start


class PCMDecoder:
    """PCM16 little-endian mono bytes at `sample_rate` -> float32 16 kHz, streamed (a chunk may
    end in the middle of a sample; soxr keeps its filter state across chunks)."""

    def __init__(self, sample_rate: int) -> None:
        import soxr

        self.sample_rate = sample_rate
        self.carry = b""
        self.resampler = (
            None
            if sample_rate == SAMPLE_RATE
            else soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        )

    def decode(self, data: bytes, last: bool = False) -> np.ndarray:
        data = self.carry + data
        usable = len(data) - len(data) % 2
        self.carry = data[usable:]
        samples = np.frombuffer(data[:usable], dtype="<i2").astype(np.float32) / 32768.0
        if self.resampler is None:
            return samples
        return self.resampler.resample_chunk(samples, last=last)


class RealtimeSession:
    """One client's stream: `append` audio, `commit` / `clear` the buffer, `update` the config;
    events go to `emit` in order (deltas of a turn before its completion, completions in the
    order of their commits). `close` cancels every hypothesis and transcription in flight,
    which aborts their engine requests."""

    def __init__(
        self,
        transcriber: AsyncTranscriber,
        emit: Callable[[SessionEvent], None],
        config: SessionConfig | None = None,
        limits: SessionLimits | None = None,
        session_id: str | None = None,
        vad_factory: Callable[[ServerVad], TurnDetector] | None = None,
    ) -> None:
        self.transcriber = transcriber
        self.emit = emit
        self.limits = limits or SessionLimits()
        self.session_id = session_id or f"sess_{uuid.uuid4().hex[:20]}"
        self.vad_factory = vad_factory or TurnDetector
        self.config = SessionConfig()
        self.buffer = _AudioBuffer()
        self.decoder = PCMDecoder(self.config.input_sample_rate)
        self.detector: TurnDetector | None = None
        self.turn_start: int | None = None
        """Session sample where the turn being spoken started (VAD: after speech_started)."""
        self.item_id = self._new_item_id()
        self.previous_item_id: str | None = None
        self.agreement = LocalAgreement()
        self.partial_task: asyncio.Task[None] | None = None
        self.partial_at = 0
        """Buffer end (session samples) of the last hypothesis started."""
        self.last_completion: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.num_requests = 0
        self.update(config or SessionConfig())

    # ---- client events ----
    def update(self, config: SessionConfig) -> None:
        """A new configuration; a change of rate or turn detection starts a fresh buffer."""
        if config.input_sample_rate != self.config.input_sample_rate:
            self.decoder = PCMDecoder(config.input_sample_rate)
        if config.turn_detection != self.config.turn_detection or self.detector is None:
            self.detector = (
                None if config.turn_detection is None else self.vad_factory(config.turn_detection)
            )
            self._reset_turn()
            self.buffer.drop_before(self.buffer.end)
        self.config = config

    def append(self, pcm16: bytes) -> None:
        """Audio at the session's rate; RealtimeError past the buffer bound (nothing kept)."""
        samples = self.decoder.decode(pcm16)
        limit = int(self.limits.max_buffer_seconds * SAMPLE_RATE)
        if self.buffer.num_samples + samples.size > limit:
            raise RealtimeError(
                f"the input audio buffer would hold more than {self.limits.max_buffer_seconds:g} s "
                "of audio; commit or clear it first",
                "input_audio_buffer_full",
            )
        start = self.buffer.end
        self.buffer.append(samples)
        if self.detector is None:
            self._maybe_partial(self.buffer.start)
            return
        for event in self.detector.feed(samples, start):
            self._on_turn_event(event)
        if self.turn_start is None:
            # Between turns only the prefix padding can still become part of a turn.
            assert self.config.turn_detection is not None
            keep = self.config.turn_detection.prefix_padding_ms * SAMPLES_PER_MS
            self.buffer.drop_before(
                min(self.buffer.end - keep, self.detector.pending_start(self.buffer.end) - keep)
            )
        else:
            self._maybe_partial(self.turn_start)

    def commit(self) -> None:
        """The buffer (VAD: the turn so far) becomes a turn; RealtimeError when too short."""
        start = self.buffer.start if self.turn_start is None else self.turn_start
        if self.buffer.end - start < MIN_TURN_SAMPLES:
            raise RealtimeError(
                "buffer too small: expected at least 100 ms of audio, got "
                f"{(self.buffer.end - start) / SAMPLES_PER_MS:.2f} ms",
                "input_audio_buffer_commit_empty",
            )
        self._commit_turn(start, self.buffer.end)
        if self.detector is not None:
            self.detector.reset()

    def clear(self) -> None:
        """Drop the uncommitted audio (and the turn being spoken)."""
        self._cancel_partial()
        self.buffer.drop_before(self.buffer.end)
        if self.detector is not None:
            self.detector.reset()
        self._reset_turn()
        self.emit(Cleared())

    @property
    def busy(self) -> bool:
        """Whether a hypothesis or a turn's transcription is in flight."""
        return bool(self.tasks)

    async def close(self) -> None:
        """Cancels every engine request of the session and waits for them to end."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- turns ----
    def _on_turn_event(self, event: TurnEvent) -> None:
        assert self.config.turn_detection is not None
        if event.kind == "start" and self.turn_start is None:
            padding = self.config.turn_detection.prefix_padding_ms * SAMPLES_PER_MS
            start = max(self.buffer.start, event.sample - padding)
            self.turn_start = start - start % SAMPLES_PER_MS  # whole milliseconds
            self.partial_at = self.turn_start
            self.emit(SpeechStarted(self.item_id, self.turn_start // SAMPLES_PER_MS))
        elif event.kind == "end" and self.turn_start is not None:
            end = min(event.sample - event.sample % SAMPLES_PER_MS, self.buffer.end)
            self.emit(SpeechStopped(self.item_id, end // SAMPLES_PER_MS))
            self._commit_turn(self.turn_start, end)

    def _commit_turn(self, start: int, end: int) -> None:
        audio = self.buffer.slice(start, end).copy()
        item_id, previous = self.item_id, self.previous_item_id
        self.emit(Committed(item_id, previous))
        self._cancel_partial()
        agreed = self.agreement.text
        self.last_completion = self._spawn(
            self._complete(item_id, audio, agreed, self.last_completion)
        )
        self.buffer.drop_before(end)
        self.previous_item_id = item_id
        self.item_id = self._new_item_id()
        self._reset_turn()

    def _reset_turn(self) -> None:
        self.turn_start = None
        self.agreement = LocalAgreement()
        self.partial_at = self.buffer.end

    async def _complete(
        self,
        item_id: str,
        audio: np.ndarray,
        agreed: str,
        before: asyncio.Task[None] | None,
    ) -> None:
        try:
            result = await self._transcribe(audio, final=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the turn's own failure, reported to the client
            logger.warning("realtime transcription of %s failed: %s", item_id, e)
            result = e
        if before is not None:  # completions go out in commit order
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(before)
        if isinstance(result, Exception):
            self.emit(TranscriptFailed(item_id, str(result)))
            return
        if result.text.startswith(agreed) and len(result.text) > len(agreed):
            # The deltas of a turn add up to its transcript when the hypotheses led there.
            self.emit(TranscriptDelta(item_id, result.text[len(agreed) :]))
        self.emit(TranscriptCompleted(item_id, result.text, audio.size / SAMPLE_RATE))

    # ---- hypotheses of the turn being spoken ----
    def _maybe_partial(self, turn_start: int) -> None:
        interval = int(self.limits.partial_interval_s * SAMPLE_RATE)
        if interval <= 0 or self.partial_task is not None:
            return
        if self.last_completion is not None and not self.last_completion.done():
            return  # a finished turn's transcript comes first; hypotheses never queue up
        if self.buffer.end - self.partial_at < interval:
            return
        self.partial_at = self.buffer.end
        audio = self.buffer.slice(turn_start, self.buffer.end).copy()
        self.partial_task = self._spawn(self._partial(self.item_id, audio, self.agreement))

    async def _partial(self, item_id: str, audio: np.ndarray, agreement: LocalAgreement) -> None:
        try:
            result = await self._transcribe(audio, final=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed hypothesis only loses its deltas
            logger.warning("realtime hypothesis of %s failed: %s", item_id, e)
            return
        finally:
            if self.partial_task is asyncio.current_task():
                self.partial_task = None
        if agreement is not self.agreement:  # the turn was committed or cleared meanwhile
            return
        delta = agreement.update(result.text)
        if delta:
            self.emit(TranscriptDelta(item_id, delta))

    def _cancel_partial(self) -> None:
        if self.partial_task is not None:
            self.partial_task.cancel()
            self.partial_task = None

    async def _transcribe(self, audio: np.ndarray, final: bool) -> TranscriptionResult:
        """The engine's transcription of `audio` (a turn: the session's options, as
        `LLM.transcribe`; a hypothesis: greedy only, no temperature fallback)."""
        self.num_requests += 1
        options = TranscriptionOptions(
            language=self.config.language,
            prompt=self.config.prompt,
            temperature=None if final else 0.0,
        )
        prefix = f"{self.session_id}-{'turn' if final else 'hyp'}{self.num_requests}"
        planner = await self.transcriber.prepare(options, prefix)
        events = self.transcriber.events(planner, [audio])
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, InputDone):
                    return event.result
        raise AssertionError("transcription ended without a result")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    @staticmethod
    def _new_item_id() -> str:
        return f"item_{uuid.uuid4().hex[:20]}"


async def check_session_options(transcriber: AsyncTranscriber, config: SessionConfig) -> None:
    """ValueError (as RealtimeError) when the engine cannot run `config`'s language or prompt."""
    try:
        await transcriber.prepare(
            TranscriptionOptions(language=config.language, prompt=config.prompt),
            f"check-{uuid.uuid4().hex}",
        )
    except ValueError as e:
        param = "language" if "language" in str(e) else "prompt"
        raise RealtimeError(str(e), "invalid_value", param) from e
