"""split_windows and Whisper timestamp-token segment math."""

from __future__ import annotations

import numpy as np
import pytest

from v1.audio import Segment, split_windows, timestamp_segments, timestamp_to_seconds

SR = 16_000
TS = 50_364  # whisper multilingual <|0.00|>
EOT = 50_257


def ts(seconds: float) -> int:
    return TS + round(seconds / 0.02)


def test_split_windows_covers_the_audio_in_30s_steps() -> None:
    audio = np.arange(75 * SR, dtype=np.float32)
    windows = split_windows(audio)
    assert [w.offset_seconds for w in windows] == [0.0, 30.0, 60.0]
    assert [w.samples.shape[0] for w in windows] == [30 * SR, 30 * SR, 15 * SR]
    assert [w.duration_seconds for w in windows] == [30.0, 30.0, 15.0]
    np.testing.assert_array_equal(np.concatenate([w.samples for w in windows]), audio)
    assert np.shares_memory(windows[1].samples, audio)  # views, no copies


@pytest.mark.parametrize(
    ("seconds", "window_s", "expected_offsets"),
    [
        (60.0, 30.0, [0.0, 30.0]),
        (0.5, 30.0, [0.0]),
        (0.0, 30.0, []),
        (25.0, 10.0, [0.0, 10.0, 20.0]),
    ],
)
def test_split_windows_edges(
    seconds: float, window_s: float, expected_offsets: list[float]
) -> None:
    audio = np.zeros(int(seconds * SR), np.float32)
    windows = split_windows(audio, sr=SR, window_s=window_s)
    assert [w.offset_seconds for w in windows] == expected_offsets
    assert sum(w.samples.shape[0] for w in windows) == audio.shape[0]


def test_split_windows_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="1-D"):
        split_windows(np.zeros((2, SR), np.float32))
    with pytest.raises(ValueError, match="positive"):
        split_windows(np.zeros(SR, np.float32), window_s=0)


def test_timestamp_to_seconds() -> None:
    assert timestamp_to_seconds(TS, TS) == 0.0
    assert timestamp_to_seconds(TS + 1500, TS) == pytest.approx(30.0)


def test_paired_timestamps_make_segments_with_the_window_offset() -> None:
    tokens = [ts(0.0), 1, 2, ts(2.4), ts(2.4), 3, ts(5.0), EOT]
    segments = timestamp_segments(tokens, timestamp_begin=TS, offset_seconds=30.0, eos_token_id=EOT)
    assert segments == [
        Segment(30.0, pytest.approx(32.4), [1, 2]),
        Segment(pytest.approx(32.4), 35.0, [3]),
    ]


def test_single_timestamp_between_texts_ends_one_and_starts_the_next() -> None:
    segments = timestamp_segments([ts(1.0), 7, ts(3.0), 8, ts(4.0)], timestamp_begin=TS)
    assert [(s.start, s.end, s.token_ids) for s in segments] == [
        (1.0, 3.0, [7]),
        (3.0, 4.0, [8]),
    ]


def test_final_unpaired_timestamps() -> None:
    # A closing timestamp at the end: the last segment ends there.
    closed = timestamp_segments([ts(0.0), 1, ts(2.0)], timestamp_begin=TS, window_seconds=12.0)
    assert [(s.start, s.end) for s in closed] == [(0.0, 2.0)]
    # An opening timestamp whose text never closes: the segment runs to the window end.
    open_ = timestamp_segments(
        [ts(0.0), 1, ts(2.0), ts(2.0), 5, 6],
        timestamp_begin=TS,
        offset_seconds=60.0,
        window_seconds=12.0,
    )
    assert [(s.start, s.end, s.token_ids) for s in open_] == [
        (60.0, 62.0, [1]),
        (62.0, 72.0, [5, 6]),
    ]
    # A trailing opening timestamp with no text adds nothing.
    trailing = timestamp_segments([ts(0.0), 1, ts(2.0), ts(2.0)], timestamp_begin=TS)
    assert len(trailing) == 1


def test_no_timestamps_gives_one_segment_covering_the_window() -> None:
    segments = timestamp_segments(
        [4, 5, 6, EOT, 9],
        timestamp_begin=TS,
        offset_seconds=90.0,
        window_seconds=7.5,
        eos_token_id=EOT,
    )
    assert segments == [Segment(90.0, 97.5, [4, 5, 6])]
    assert timestamp_segments([], timestamp_begin=TS) == []
    assert timestamp_segments([ts(0.0), ts(1.0)], timestamp_begin=TS) == []


def test_end_before_start_is_clamped() -> None:
    (segment,) = timestamp_segments([ts(5.0), 1, ts(4.0)], timestamp_begin=TS)
    assert (segment.start, segment.end) == (5.0, 5.0)
