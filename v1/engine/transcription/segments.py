"""One file's decoded windows -> its timed segments and result (`SegmentAssembler`), with the
segment and result types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from v1.audio.vad import SpeechMap
from v1.engine.transcription.seek import FRAMES_PER_SECOND, DecodeQuality, Verdict
from v1.engine.transcription.words import TranscriptionWord, WordClock


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
    language: str | None = None
    """Language the segment was decoded in (detected per window with multilingual=True)."""


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
    language_probability: float | None = None
    """Probability of the detected language token at <|startoftranscript|> (raw softmax over
    the vocabulary); 1.0 when the language was given."""


@dataclass(frozen=True)
class Attempt:
    """The decoding of one window that was kept (after any fallback)."""

    content: list[int]
    """Sampled tokens before EOS."""
    quality: DecodeQuality
    temperature: float
    verdict: Verdict
    """ACCEPT or SKIP."""
    token_times: list[float] | None = None
    """WindowOutput.token_times of this decoding."""
    text_probs: list[float] | None = None
    """Probability of each text token of `content` (timestamps left out), in order."""


@dataclass(frozen=True)
class DecodedWindow:
    seek: int
    """Start of the window in frames."""
    segments: list[tuple[float, float, list[int]]]
    """(start s, end s, text token ids) of each segment."""
    attempt: Attempt
    language: str | None = None
    last_word_end: float | None = None
    """End of the window's last kept word (hallucination_silence_threshold only)."""


class SegmentAssembler:
    """One file's decoded windows -> its segments, window by window: each window's segments
    are final as soon as it is added (in time order, clamped into the audio and never
    overlapping; segments without text are dropped; vad_filter times back on the recording's
    clock) and go to `on_segment` at once; `result` is the file's TranscriptionResult."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        eos: int,
        duration: float,
        word_timestamps: bool,
        speech_map: SpeechMap | None,
        on_segment: Callable[[TranscriptionSegment], None] | None,
    ) -> None:
        self.decode = decode
        self.eos = eos
        self.duration = duration
        """Seconds of the decoded audio (speech only with vad_filter)."""
        self.speech_map = speech_map
        self.on_segment = on_segment
        self.windows: list[DecodedWindow] = []
        self.segments: list[TranscriptionSegment] = []
        self.text_ids: list[int] = []
        self.last_end = 0.0
        self.clock = WordClock(decode, eos, "en", duration) if word_timestamps else None

    def add(self, window: DecodedWindow) -> None:
        self.windows.append(window)
        quality = window.attempt.quality
        clock = self.clock
        if clock is not None:
            times = window.attempt.token_times
            if times is None and window.segments:
                raise TranscriptionError(
                    f"the window at {window.seek / FRAMES_PER_SECOND:.2f} s came back "
                    "without word timings"
                )
            clock.language = window.language or clock.language
            clock.start_window(
                times or [], window.seek / FRAMES_PER_SECOND, window.attempt.text_probs
            )
        for start, end, text_ids in window.segments:
            words = clock.segment_words(text_ids) if clock is not None else None
            if not text_ids:
                continue
            self.text_ids += text_ids
            start = min(max(start, self.last_end), self.duration)
            end = min(max(end, start), self.duration)
            self.last_end = end
            segment = TranscriptionSegment(
                id=len(self.segments),
                start=round(start, 3),
                end=round(end, 3),
                text=self.decode(text_ids),
                tokens=text_ids,
                avg_logprob=quality.avg_logprob,
                compression_ratio=quality.compression_ratio,
                no_speech_prob=quality.no_speech_prob,
                temperature=window.attempt.temperature,
                seek=window.seek,
                words=words,
                language=window.language,
            )
            if self.speech_map is not None:
                restore_times(segment, self.speech_map)
            self.segments.append(segment)
            if self.on_segment is not None:
                self.on_segment(segment)

    def result(self, language: str) -> TranscriptionResult:
        segments = self.segments
        for segment in segments:
            segment.language = segment.language or language
        # One segment (every short-form clip): its text is the whole text, decoded once.
        text = segments[0].text if len(segments) == 1 else self.decode(self.text_ids)
        return TranscriptionResult(
            text=text,
            language=language,
            duration=self.duration,
            segments=segments,
            words=[w for s in segments for w in s.words or []] if self.clock else None,
        )


def restore_times(seg: TranscriptionSegment, speech_map: SpeechMap) -> None:
    """Times on the speech-only audio (vad_filter) -> the recording's clock, in place."""
    seg.start = speech_map.original_time(seg.start)
    seg.end = max(seg.start, speech_map.original_time(seg.end, is_end=True))
    for word in seg.words or []:
        word.start = speech_map.original_time(word.start)
        word.end = max(word.start, speech_map.original_time(word.end, is_end=True))
