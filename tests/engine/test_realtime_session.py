"""RealtimeSession without an engine: a scripted transcriber whose every call the test releases
by hand, so the order of hypotheses, deltas, commits and completions is exact (the server tests
drive the same session through /v1/realtime with whisper-base). Also LocalAgreement-2, the PCM16
decoder (streamed soxr == one-shot) and server VAD turns over the project's Silero VAD."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import soxr

from tests.utils import ASSETS, require_asset
from v1.audio.vad import VadOptions, get_speech_timestamps
from v1.engine.realtime import (
    Cleared,
    Committed,
    LocalAgreement,
    PCMDecoder,
    RealtimeError,
    RealtimeSession,
    ServerVad,
    SessionConfig,
    SessionLimits,
    SpeechStarted,
    SpeechStopped,
    TranscriptCompleted,
    TranscriptDelta,
)
from v1.engine.transcription import InputDone, TranscriptionResult

SENTENCE = " And so my fellow Americans, ask not what your country can do for you"
WORDS = SENTENCE.split(" ")[1:]


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _tone(seconds: float, rate: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


class ScriptedTranscriber:
    """Stands in for AsyncTranscriber: a call's text is the first `seconds * 2` words of
    SENTENCE, the last one cut short (it is still being spoken); a call returns only when the
    test releases it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.cancelled = 0

    async def prepare(self, options: Any, request_id: str | None = None, **_: Any) -> Any:
        return {"options": options, "request_id": request_id}

    async def events(self, planner: Any, waveforms: list[np.ndarray]) -> AsyncIterator[Any]:
        call = {
            "final": "turn" in planner["request_id"],
            "audio": waveforms[0],
            "options": planner["options"],
            "release": asyncio.Event(),
        }
        self.calls.append(call)
        try:
            await call["release"].wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        seconds = waveforms[0].size / 16_000
        words = WORDS[: int(seconds * 2)]
        if words and not call["final"]:
            words[-1] = words[-1][: max(1, len(words[-1]) // 2)]  # the word being spoken
        text = "".join(" " + w for w in words)
        yield InputDone(0, TranscriptionResult(text=text, language="en", duration=seconds))

    async def release(self, index: int) -> None:
        self.calls[index]["release"].set()
        await settle()


async def settle() -> None:
    """Lets every task the session started run up to its next wait."""
    for _ in range(10):
        await asyncio.sleep(0)


def _session(
    config: SessionConfig, **limits: Any
) -> tuple[RealtimeSession, ScriptedTranscriber, list[Any]]:
    transcriber = ScriptedTranscriber()
    events: list[Any] = []
    session = RealtimeSession(transcriber, events.append, config, SessionLimits(**limits))  # type: ignore[arg-type]
    return session, transcriber, events


def test_local_agreement_emits_only_what_two_hypotheses_agree_on_and_never_retracts() -> None:
    agreement = LocalAgreement()
    assert agreement.update(" And so my fel") == ""
    assert agreement.update(" And so my fellow Amer") == " And so my"
    assert agreement.update(" And so my fellow Americans, ask") == " fellow"
    # A hypothesis that rewrites emitted text emits nothing, and nothing is taken back.
    assert agreement.update(" And sew my fellow Americans, ask not") == ""
    assert agreement.update(" And so my fellow Americans, ask not what") == ""
    assert agreement.update(" And so my fellow Americans, ask not what your") == (
        " Americans, ask not what"
    )
    assert agreement.text == " And so my fellow Americans, ask not what"


def test_pcm_decoder_streams_odd_chunks_exactly_like_one_shot_resampling() -> None:
    samples = _tone(1.3, 24_000) + 0.01 * np.random.default_rng(0).standard_normal(31_200).astype(
        np.float32
    )
    pcm = _pcm16(samples)
    decoder = PCMDecoder(24_000)
    pieces = [decoder.decode(pcm[i : i + 777]) for i in range(0, len(pcm), 777)]  # odd sizes
    pieces.append(decoder.decode(b"", last=True))
    streamed = np.concatenate(pieces)
    exact = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    whole = soxr.resample(exact, 24_000, 16_000, quality="HQ")
    assert np.array_equal(streamed, whole)
    same_rate = PCMDecoder(16_000)
    assert np.array_equal(
        np.concatenate([same_rate.decode(pcm[:3]), same_rate.decode(pcm[3:])]), exact
    )


def test_deltas_arrive_while_the_turn_is_spoken_and_add_up_to_the_transcript() -> None:
    async def run() -> None:
        session, transcriber, events = _session(
            SessionConfig(input_sample_rate=16_000, turn_detection=None, language="en")
        )
        second = _pcm16(_tone(1.0))
        session.append(second)  # 1 s: the first hypothesis starts
        await settle()
        assert [c["final"] for c in transcriber.calls] == [False]
        session.append(second)  # one hypothesis at a time: none more while it runs
        await settle()
        assert len(transcriber.calls) == 1
        await transcriber.release(0)  # " And s" (cut): one hypothesis agrees with nothing
        assert events == []
        session.append(second)  # 3 s, over 1 s of new audio since: the second hypothesis
        await settle()
        assert len(transcriber.calls) == 2
        await transcriber.release(1)  # " And so my fellow Americans, as": " And" agreed
        assert [type(e) for e in events] == [TranscriptDelta]
        assert events[0].delta == " And"
        item_id = events[0].item_id
        session.append(second)  # 4 s: the third hypothesis
        await settle()
        assert len(transcriber.calls) == 3
        await transcriber.release(2)  # "... Americans, ask not wh"
        assert events[1] == TranscriptDelta(item_id, " so my fellow Americans,")
        session.commit()  # 4 s: the turn's transcription; the hypotheses stop
        await settle()
        assert isinstance(events[-1], Committed) and events[-1].item_id == item_id
        final = transcriber.calls[-1]
        assert final["final"] and final["audio"].size == 4 * 16_000
        assert final["options"].language == "en" and final["options"].temperature is None
        await transcriber.release(len(transcriber.calls) - 1)
        completed = events[-1]
        assert isinstance(completed, TranscriptCompleted) and completed.item_id == item_id
        assert completed.transcript == "".join(" " + w for w in WORDS[:8])
        assert completed.seconds == 4.0
        # The rest of the transcript goes out as a last delta, before the completion.
        assert events[-2] == TranscriptDelta(item_id, " ask not what")
        deltas = [e.delta for e in events if isinstance(e, TranscriptDelta)]
        assert "".join(deltas) == completed.transcript

    asyncio.run(run())


def test_completions_go_out_in_commit_order_and_close_cancels_work() -> None:
    async def run() -> None:
        session, transcriber, events = _session(
            SessionConfig(input_sample_rate=16_000, turn_detection=None),
            partial_interval_s=0,
        )
        session.append(_pcm16(_tone(1.0)))
        await settle()
        session.commit()
        await settle()
        session.append(_pcm16(_tone(2.0)))
        await settle()
        session.commit()
        await settle()
        assert [c["audio"].size for c in transcriber.calls] == [16_000, 32_000]
        await transcriber.release(1)  # the second turn is done first ...
        assert not any(isinstance(e, TranscriptCompleted) for e in events)
        await transcriber.release(0)  # ... but goes out after the first
        done = [e for e in events if isinstance(e, TranscriptCompleted)]
        committed = [e for e in events if isinstance(e, Committed)]
        assert [e.item_id for e in done] == [e.item_id for e in committed]
        assert committed[1].previous_item_id == committed[0].item_id
        with pytest.raises(RealtimeError) as info:
            session.commit()  # nothing buffered
        assert info.value.code == "input_audio_buffer_commit_empty"
        session.append(_pcm16(_tone(1.0)))
        await settle()
        session.commit()
        await settle()
        assert session.busy
        await session.close()
        assert transcriber.cancelled == 1 and not session.busy

    asyncio.run(run())


def test_buffer_bound_and_clear() -> None:
    async def run() -> None:
        session, _, events = _session(
            SessionConfig(input_sample_rate=16_000, turn_detection=None),
            max_buffer_seconds=2.0,
            partial_interval_s=0,
        )
        session.append(_pcm16(_tone(1.5)))
        await settle()
        with pytest.raises(RealtimeError) as info:
            session.append(_pcm16(_tone(1.0)))
        assert info.value.code == "input_audio_buffer_full"
        assert session.buffer.num_samples == 24_000  # the refused audio was not kept
        session.clear()
        assert events == [Cleared()] and session.buffer.num_samples == 0
        session.append(_pcm16(_tone(1.5)))  # room again
        await settle()

    asyncio.run(run())


def test_server_vad_cuts_turns_at_the_reported_milliseconds() -> None:
    """Real speech through the project's Silero VAD: speech_started (prefix padding included)
    and speech_stopped bound exactly the audio the turn's transcription gets."""
    clip = require_asset(ASSETS / "audio" / "librispeech" / "test_audio_0.flac")
    speech, rate = sf.read(str(clip), dtype="float32")
    assert rate == 16_000
    silence = np.zeros(16_000, np.float32)
    stream = np.concatenate([silence, speech, silence, silence])
    pcm = _pcm16(stream)

    async def run() -> None:
        vad = ServerVad(prefix_padding_ms=300, silence_duration_ms=800)
        session, transcriber, events = _session(
            SessionConfig(input_sample_rate=16_000, turn_detection=vad), partial_interval_s=0
        )
        for start in range(0, len(pcm), 3_200):
            session.append(pcm[start : start + 3_200])
            await settle()
        kinds = [type(e) for e in events]
        assert kinds == [SpeechStarted, SpeechStopped, Committed], kinds
        started, stopped = events[0], events[1]
        # The offline VAD's speech span of the same stream, less the prefix padding.
        exact = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        ((speech_start, speech_end),) = get_speech_timestamps(
            exact, VadOptions(min_silence_duration_ms=800, speech_pad_ms=0)
        )
        assert started.audio_start_ms == (speech_start - 300 * 16) // 16
        assert speech_end // 16 < stopped.audio_end_ms <= speech_end // 16 + 800
        (turn,) = transcriber.calls
        cut = exact[started.audio_start_ms * 16 : stopped.audio_end_ms * 16]
        assert np.array_equal(turn["audio"], cut)
        # Between turns only the prefix padding (and the VAD's lookback) stays buffered.
        assert session.buffer.num_samples <= 16_000
        await transcriber.release(0)
        assert isinstance(events[-1], TranscriptCompleted)

    asyncio.run(run())
