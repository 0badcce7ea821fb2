"""hallucination_silence_threshold as faster-whisper's `generate_segments` applies it, through
the public `Transcriber` over the scripted engine of test_transcription_plan.py: the window
seeks to its last word's end when it does not end on a single timestamp, and a hallucination
between silences is dropped with what follows, seek moved to it, and its tokens kept out of the
next window's prompt. Each test fails if the rule were left out."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.test_transcription_plan import SOT, SR, Call, Reply, noise, scripted, ts, words
from v1.engine.transcription import Transcriber

pytestmark = pytest.mark.filterwarnings("ignore")


def _run(config: Any, answer: Any, seconds: float, **options: Any) -> tuple[Any, Any]:
    engine = scripted(config, answer)
    (result,) = Transcriber(engine).transcribe(
        (noise(seconds), SR), language="en", word_timestamps=True, timestamps=True, **options
    )
    return engine, result


def test_hallucination_between_silences_is_dropped_and_kept_out_of_the_prompt(
    aligned_config,
) -> None:
    """Window 0 of 25 s: ' Real words here.' at 0-0.9 s, then ' Thanks.' as a zero-length
    word at 0.9 s (an anomaly) with nothing after it: it is within the threshold of the
    start (silence before) and 29 s from the window's end (silence after). With the
    threshold it goes, the next window starts at 1 s (max(offset + 1, its start)), and that
    window's prompt holds the real words only (faster-whisper truncates current_segments
    before they extend all_tokens)."""
    tok = aligned_config[1]
    real, ghost = words(tok, " Real words here."), words(tok, " Thanks.")
    later = words(tok, " Later.")
    times = [0.9 * k / len(real) for k in range(len(real) + 1)] + [0.9] * len(ghost)

    def answer(call: Call) -> Reply:
        if call.request_id.endswith("-0"):
            tokens = [ts(0), *real, ts(0.9), ts(0.9), *ghost, ts(1.0)]
            return Reply(tokens, token_times=times)
        return Reply([ts(0), *later, ts(1)], token_times=[0.5 * k for k in range(len(later) + 1)])

    engine, result = _run(aligned_config, answer, 25)
    assert [s.text for s in result.segments] == [" Real words here.", " Thanks."]
    assert len(engine.calls) == 1  # the window ended on a single timestamp: done

    engine, result = _run(aligned_config, answer, 25, hallucination_silence_threshold=2.0)
    assert [s.text for s in result.segments] == [" Real words here.", " Later."]
    assert engine.calls[1].audio.shape[0] == 24 * SR  # seek moved to 1 s
    prompt = engine.calls[1].prompt_ids
    previous = prompt[: prompt.index(SOT)]
    assert set(real) <= set(previous) and not (set(ghost) - set(real)) & set(previous)
    assert result.segments[1].start == 1.0


def test_a_window_cut_mid_segment_seeks_to_its_last_word_end(aligned_config) -> None:
    """Window 0 ends on a segment the window edge cut (no single timestamp at the end): the
    next window starts at the last kept word's end (1.5 s), not at the segment's closing
    timestamp (2 s), as faster-whisper does with word timestamps."""
    tok = aligned_config[1]
    real, cut = words(tok, " Real words."), words(tok, " and then")
    times = [1.5 * k / len(real) for k in range(len(real) + 1)]
    times += [2.0 + 0.3 * k for k in range(1, len(cut) + 1)]

    def answer(call: Call) -> Reply:
        if call.request_id.endswith("-0"):
            return Reply([ts(0), *real, ts(2), ts(2), *cut], token_times=times)
        return Reply([ts(0), *words(tok, " Rest."), ts(1)], token_times=[0.0, 0.5, 1.0])

    engine, _ = _run(aligned_config, answer, 25)
    assert engine.calls[1].audio.shape[0] == 23 * SR  # from the closing timestamp, 2 s
    engine, _ = _run(aligned_config, answer, 25, hallucination_silence_threshold=2.0)
    assert engine.calls[1].audio.shape[0] == int(23.5 * SR)  # from the last word's end
