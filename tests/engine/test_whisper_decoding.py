"""Whisper's long-form rules without a model: seek and segments of one window (against
transformers' own `_retrieve_segment` on random valid token sequences), the compression ratio
(against transformers'), and the temperature-fallback verdicts."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from v1.engine.transcription.seek import (
    DecodeQuality,
    TemperatureFallback,
    Verdict,
    WindowSegment,
    average_logprob,
    compression_ratio,
    seek_window,
)

TB = 50364
"""<|0.00|> of the multilingual vocabulary."""
EOS = 50257
VOCAB = 51865


def ts(seconds: float) -> int:
    return TB + round(seconds / 0.02)


def test_a_window_ending_on_one_timestamp_is_done() -> None:
    tokens = [ts(0), 10, 11, ts(5), ts(5), 12, ts(9.5)]
    segments, next_seek = seek_window(tokens, seek=1000, num_frames=3000, timestamp_begin=TB)
    assert next_seek == 4000
    assert segments == [
        WindowSegment(1000, 1500, [ts(0), 10, 11, ts(5)]),
        WindowSegment(1500, 1950, [ts(5), 12, ts(9.5)]),
    ]
    assert (segments[1].start, segments[1].end) == (15.0, 19.5)


def test_text_cut_by_the_window_edge_is_decoded_again_from_the_last_pair() -> None:
    # "...<|22.00|><|22.00|><|endoftext|>": the next window starts at 22 s.
    tokens = [ts(0), 10, ts(11), ts(11), 11, ts(22), ts(22)]
    segments, next_seek = seek_window(tokens, seek=0, num_frames=3000, timestamp_begin=TB)
    assert next_seek == 2200
    assert [s.token_ids for s in segments] == [[ts(0), 10, ts(11)], [ts(11), 11, ts(22)]]
    # Text after the last pair is dropped (decoded again by the next window).
    tokens = [ts(0), 10, ts(11), ts(11), 11, 12]
    segments, next_seek = seek_window(tokens, seek=500, num_frames=3000, timestamp_begin=TB)
    assert next_seek == 500 + 1100
    assert [s.token_ids for s in segments] == [[ts(0), 10, ts(11)]]


def test_windows_without_a_timestamp_pair_are_one_segment() -> None:
    segments, next_seek = seek_window(
        [ts(0), 10, 11, ts(7)], seek=0, num_frames=2500, timestamp_begin=TB
    )
    assert (segments, next_seek) == ([WindowSegment(0, 700, [ts(0), 10, 11, ts(7)])], 2500)
    segments, next_seek = seek_window([ts(0), 10, 11], seek=0, num_frames=2500, timestamp_begin=TB)
    assert (segments[0].end_frame, next_seek) == (2500, 2500)
    assert seek_window([], seek=30, num_frames=10, timestamp_begin=TB) == (
        [WindowSegment(30, 40, [])],
        40,
    )


def test_a_pair_at_the_window_start_cannot_stall_the_seek() -> None:
    segments, next_seek = seek_window([ts(0), ts(0)], seek=800, num_frames=3000, timestamp_begin=TB)
    assert next_seek == 3800
    assert segments == [WindowSegment(800, 800, [ts(0)])]


def _random_window(rng: random.Random) -> list[int]:
    """Tokens the timestamp rules allow: a first timestamp, then text runs separated by
    non-decreasing timestamps, single or paired, possibly ending mid-text."""
    tokens = [ts(rng.choice([0.0, 0.2, 1.0]))]
    t = tokens[0] - TB
    for _ in range(rng.randint(0, 5)):
        tokens += [rng.randint(10, 5000) for _ in range(rng.randint(1, 4))]
        t += rng.randint(0, 300)
        tokens.append(TB + min(t, 1500))
        if rng.random() < 0.7:
            tokens.append(TB + min(t, 1500))  # a pair: one segment ends, the next starts
    if rng.random() < 0.4:
        tokens += [rng.randint(10, 5000) for _ in range(rng.randint(1, 3))]
    return tokens


def test_segments_and_seek_equal_transformers_on_random_windows() -> None:
    rng = random.Random(13)
    for case in range(400):
        tokens = _random_window(rng)
        seek = rng.choice([0, 2200, 4517])
        num_frames = rng.choice([3000, 1234])
        segments, next_seek = seek_window(
            tokens, seek=seek, num_frames=num_frames, timestamp_begin=TB
        )
        ref, offset = WhisperGenerationMixin._retrieve_segment(
            seek_sequence=torch.tensor(tokens),
            seek_outputs=[None],
            time_offset=torch.tensor([seek * 0.01], dtype=torch.float64),
            timestamp_begin=TB,
            seek_num_frames=torch.tensor([num_frames]),
            time_precision=0.02,
            time_precision_features=0.01,
            input_stride=2,
            prev_idx=0,
            idx=0,
            return_token_timestamps=False,
            decoder_input_ids=torch.zeros(1, 3, dtype=torch.long),
        )
        if int(offset) == 0:  # transformers would decode the same window again for ever
            assert next_seek == seek + num_frames
            continue
        assert next_seek == seek + int(offset), (case, tokens)
        assert len(segments) == len(ref), (case, tokens)
        for ours, theirs in zip(segments, ref, strict=True):
            assert ours.start == pytest.approx(float(theirs["start"]), abs=1e-9), (case, tokens)
            if len(ref) > 1 or tokens[-1] >= TB:  # their no-pair end is int(n * 0.01 / 0.02)
                assert ours.end == pytest.approx(float(theirs["end"]), abs=1e-9), (case, tokens)
            ref_tokens = theirs["tokens"].tolist()
            # The prompt form drops the repeated timestamp of a closing pair (transformers'
            # skip_ending_double_timestamps, which also drops a lone text token after a final
            # timestamp: a slip we do not copy).
            if len(ref_tokens) > 2 and ref_tokens[-2] >= TB and ref_tokens[-1] >= TB:
                ref_tokens = ref_tokens[:-1]
            assert ours.token_ids == ref_tokens, (case, tokens)


def test_compression_ratio_is_transformers_token_measure() -> None:
    rng = random.Random(1)
    for length in (1, 7, 60, 200):
        tokens = [rng.randint(0, VOCAB - 1) for _ in range(length)]
        expected = WhisperGenerationMixin._retrieve_compression_ratio(torch.tensor(tokens), VOCAB)
        assert compression_ratio(tokens, VOCAB) == pytest.approx(expected)
    loop = [ts(0)] + [400, 370, 452, 11] * 50
    assert compression_ratio(loop, VOCAB) > 10
    assert compression_ratio([], VOCAB) == 0.0


@pytest.mark.parametrize("vocab", [200, 51866, 70000, 2**24 + 5])
def test_compression_ratio_packs_each_id_in_the_vocabulary_width(vocab: int) -> None:
    import math
    import zlib

    rng = random.Random(vocab)
    width = int(math.log2(vocab) / 8) + 1  # 1 to 4 bytes
    for tokens in ([rng.randrange(vocab) for _ in range(150)], [vocab - 1] * 40):
        data = b"".join(t.to_bytes(width, "little") for t in tokens)
        assert compression_ratio(tokens, vocab) == len(data) / len(zlib.compress(data))


def test_average_logprob_counts_every_token() -> None:
    assert average_logprob([-0.5, -1.5, -1.0]) == pytest.approx(-1.0)
    assert math.isnan(average_logprob(None)) and math.isnan(average_logprob([]))


@pytest.mark.parametrize(
    ("quality", "verdict"),
    [
        (DecodeQuality(1.5, -0.3, 0.01), Verdict.ACCEPT),
        (DecodeQuality(2.41, -0.3, 0.01), Verdict.RETRY),  # a loop
        (DecodeQuality(1.5, -1.2, 0.01), Verdict.RETRY),  # unlikely text
        (DecodeQuality(1.5, -1.2, 0.7), Verdict.SKIP),  # unlikely and no speech: silence
        (DecodeQuality(3.0, -1.2, 0.7), Verdict.SKIP),
        (DecodeQuality(1.5, -0.5, 0.9), Verdict.ACCEPT),  # likely text wins over no-speech
        (DecodeQuality(1.5, float("nan"), None), Verdict.ACCEPT),
        (DecodeQuality(1.5, -1.2, None), Verdict.RETRY),
    ],
)
def test_fallback_verdicts(quality: DecodeQuality, verdict: Verdict) -> None:
    assert TemperatureFallback().verdict(quality) is verdict


def test_fallback_thresholds_can_be_turned_off_and_schedules_built() -> None:
    off = TemperatureFallback(
        (0.0,), compression_ratio_threshold=None, logprob_threshold=None, no_speech_threshold=None
    )
    assert off.verdict(DecodeQuality(9.0, -9.0, 1.0)) is Verdict.ACCEPT and off.is_last(0)
    no_skip = TemperatureFallback(no_speech_threshold=None)
    assert no_skip.verdict(DecodeQuality(1.0, -2.0, 1.0)) is Verdict.RETRY
    assert TemperatureFallback().temperatures == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert TemperatureFallback.starting_at(0.5).temperatures == (0.5, 0.6, 0.8, 1.0)
    assert TemperatureFallback.starting_at(1.3).temperatures == (1.3,)
    assert TemperatureFallback(0.3).temperatures == (0.3,)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperatures": ()}, "at least one value"),
        ({"temperatures": (0.0, -0.1)}, r"numbers in \[0, 2\], got -0.1"),
        ({"temperatures": (0.0, "hot")}, "numbers in"),
        ({"compression_ratio_threshold": float("nan")}, "must be finite"),
        ({"logprob_threshold": "low"}, "must be a number or None"),
        ({"no_speech_threshold": 1.5}, r"no_speech_threshold must be in \[0, 1\]"),
    ],
)
def test_bad_fallback_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TemperatureFallback(**kwargs)
