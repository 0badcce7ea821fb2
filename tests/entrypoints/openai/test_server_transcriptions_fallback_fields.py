"""faster-whisper's fallback and conditioning options as form fields of /v1/audio/transcriptions
and /translations (real whisper-base; openai client and httpx): condition_on_previous_text,
compression_ratio_threshold, log_prob_threshold (faster-whisper's name of logprob_threshold) and
no_speech_threshold each change the result when sent, and malformed values are 400s."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from tests.entrypoints.openai.conftest import AUDIO_DIR, RemoteServer, assert_error_body

pytestmark = pytest.mark.timeout(420)

MODEL = "whisper-1"
SHORT = AUDIO_DIR / "librispeech" / "test_audio_0.flac"
CLIPS = ["test_audio_0.flac", "test_audio_1.flac"]


def _two_clips() -> bytes:
    """Two LibriSpeech clips, one after the other (9.6 s)."""
    parts = [sf.read(str(AUDIO_DIR / "librispeech" / n), dtype="float32")[0] for n in CLIPS]
    buf = io.BytesIO()
    sf.write(buf, np.concatenate(parts), 16_000, format="FLAC")
    return buf.getvalue()


@pytest.mark.slow  # two requests of two windows on a CPU server
def test_condition_on_previous_text_field_changes_the_second_window(
    whisper_server: RemoteServer,
) -> None:
    """clip_timestamps cut the upload into two windows (0-4 s, then from 4.02 s); the second
    is decoded after the first one's text, unless condition_on_previous_text is false: then
    it decodes differently ("Quilter's" / "quilters'" with whisper-base)."""
    client = whisper_server.openai()
    upload = _two_clips()

    def segments(**fields: str) -> list[tuple[int, str]]:
        verbose = client.audio.transcriptions.create(
            model=MODEL,
            file=("two.flac", upload),
            language="en",
            response_format="verbose_json",
            extra_body={"clip_timestamps": "0,4,4.02", **fields},
        )
        return [(s.seek, s.text) for s in verbose.segments]

    conditioned = segments()
    unconditioned = segments(condition_on_previous_text="false")
    first = [s for s in conditioned if s[0] == 0]
    assert first and len(first) < len(conditioned)  # a second window ran
    assert unconditioned[: len(first)] == first  # the first window has no previous text
    assert unconditioned[len(first) :] != conditioned[len(first) :]


@pytest.mark.slow  # five requests, two of them with a fallback
def test_threshold_fields_change_fallback_and_silence(whisper_server: RemoteServer) -> None:
    """A log_prob_threshold no decoding meets (0) or a compression_ratio_threshold every text
    is above sends the window through every fallback temperature (from the form's 0.8: 0.8,
    then 1.0, which is kept); with no_speech_threshold 0 as well, the low logprob makes the
    window silence: skipped."""
    client = whisper_server.openai()

    def verbose(endpoint: str = "transcriptions", temperature: float = 0.0, **fields: str) -> Any:
        api = getattr(client.audio, endpoint)
        return api.create(
            model=MODEL,
            file=("short.flac", SHORT.read_bytes()),
            response_format="verbose_json",
            temperature=temperature,
            extra_body=fields,
            **({"language": "en"} if endpoint == "transcriptions" else {}),
        )

    assert {s.temperature for s in verbose(temperature=0.8).segments} == {0.8}
    for fields in ({"log_prob_threshold": "0"}, {"compression_ratio_threshold": "0.1"}):
        hot = verbose(temperature=0.8, **fields)
        assert hot.segments and {s.temperature for s in hot.segments} == {1.0}, fields
    silent = verbose(log_prob_threshold="0", no_speech_threshold="0")
    assert silent.text == "" and silent.segments == []
    # The translation form takes them too.
    fields = {"log_prob_threshold": "0", "no_speech_threshold": "0"}
    translated = verbose("translations", condition_on_previous_text="false", **fields)
    assert translated.text == "" and translated.segments == []


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
