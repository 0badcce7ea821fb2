"""faster-whisper's fallback and conditioning options as form fields of /v1/audio/transcriptions
and /translations (real whisper-base; openai client and httpx): condition_on_previous_text,
compression_ratio_threshold, log_prob_threshold (faster-whisper's name of logprob_threshold) and
no_speech_threshold each change the result when sent, and malformed values are 400s."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, RemoteServer, assert_error_body

pytestmark = pytest.mark.timeout(420)

MODEL = "whisper-1"
SHORT = AUDIO_DIR / "librispeech" / "test_audio_0.flac"


def _thirty_seconds() -> bytes:
    """jfk, a LibriSpeech clip, jfk and the other one, cut at 30 s: one upload chunk of the
    test server, whose first window ends inside the last sentence, so a second window (from
    27 s) decodes the rest with the first window's text as its prompt."""
    names = ["jfk.flac", "librispeech/test_audio_0.flac", "jfk.flac"]
    names += ["librispeech/test_audio_1.flac"]
    parts = []
    for name in names:
        samples, rate = sf.read(str(AUDIO_DIR / name), dtype="float32", always_2d=True)
        assert rate in (16_000, 44_100)
        mono = samples.mean(axis=1)
        if rate != 16_000:
            import soxr

            mono = soxr.resample(mono, rate, 16_000)
        parts.append(mono.astype(np.float32))
    audio = np.concatenate(parts)[: 30 * 16_000]
    buf = io.BytesIO()
    sf.write(buf, audio, 16_000, format="FLAC")
    return buf.getvalue()


def test_condition_on_previous_text_field_changes_the_second_window(
    whisper_server: RemoteServer,
) -> None:
    client = whisper_server.openai()
    upload = _thirty_seconds()

    def segments(**fields: str) -> list[tuple[int, float, float, str]]:
        verbose = client.audio.transcriptions.create(
            model=MODEL,
            file=("thirty.flac", upload),
            language="en",
            response_format="verbose_json",
            extra_body=fields,
        )
        return [(s.seek, s.start, s.end, s.text) for s in verbose.segments]

    conditioned = segments()
    unconditioned = segments(condition_on_previous_text="false")
    # The first window decodes the same; the second one (it starts past 0) has no prompt.
    assert conditioned[0][0] == 0 and conditioned[-1][0] > 0
    first = [s for s in conditioned if s[0] == 0]
    assert unconditioned[: len(first)] == first
    assert unconditioned[len(first) :] != conditioned[len(first) :]
    assert segments(condition_on_previous_text="true") == conditioned


def test_threshold_fields_change_fallback_and_silence(whisper_server: RemoteServer) -> None:
    """A log_prob_threshold no decoding meets (0) or a compression_ratio_threshold every text
    is above sends the window through every fallback temperature (the last is kept); with
    no_speech_threshold 0 as well, the low logprob makes the window silence: skipped."""
    client = whisper_server.openai()

    def verbose(endpoint: str = "transcriptions", **fields: str) -> object:
        api = getattr(client.audio, endpoint)
        return api.create(
            model=MODEL,
            file=("short.flac", SHORT.read_bytes()),
            response_format="verbose_json",
            extra_body=fields,
            **({"language": "en"} if endpoint == "transcriptions" else {}),
        )

    plain = verbose()
    assert "universe" in plain.text and {s.temperature for s in plain.segments} == {0.0}
    for fields in ({"log_prob_threshold": "0"}, {"compression_ratio_threshold": "0.1"}):
        hot = verbose(**fields)
        assert hot.segments and {s.temperature for s in hot.segments} == {1.0}, fields
    silent = verbose(log_prob_threshold="0", no_speech_threshold="0")
    assert silent.text == "" and silent.segments == []
    # The translation form takes them too.
    translated = verbose("translations", log_prob_threshold="0", no_speech_threshold="0")
    assert translated.text == ""
    assert verbose("translations", condition_on_previous_text="false").text.strip()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"no_speech_threshold": "2"}, "no_speech_threshold"),
        ({"no_speech_threshold": "abc"}, "no_speech_threshold"),
        ({"compression_ratio_threshold": "inf"}, "compression_ratio_threshold"),
        ({"log_prob_threshold": "nan"}, "log_prob_threshold"),
        ({"condition_on_previous_text": "maybe"}, "condition_on_previous_text"),
        ({"logprob_threshold": "-1"}, "logprob_threshold"),  # not a form field
    ],
)
@pytest.mark.parametrize("endpoint", ["transcriptions", "translations"])
def test_malformed_fallback_fields_are_400(
    whisper_server: RemoteServer, fields: dict[str, str], param: str, endpoint: str
) -> None:
    with whisper_server.http() as http:
        response = http.post(
            f"/v1/audio/{endpoint}",
            files={"file": ("short.flac", SHORT.read_bytes())},
            data={"model": MODEL, **fields},
        )
    error = assert_error_body(response, 400)
    assert error["param"] == param and param in error["message"], error
    assert "logprob_threshold" not in error["message"] or param == "logprob_threshold"
