"""`v1 transcribe` in process: transcript files in --output-dir (txt, srt, vtt, tsv, json; one
srt/vtt cue per word with --word-timestamps), faster-whisper's flags reaching the decoding, and
errors in the options reported before the model loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils import ASSETS, ONE_TORCH_THREAD, WHISPER_BASE, needs_assets
from v1.entrypoints.cli import main

pytestmark = ONE_TORCH_THREAD

AUDIO = ASSETS / "audio"
SHORT = AUDIO / "librispeech" / "test_audio_0.flac"


@pytest.fixture(autouse=True, scope="module")
def engine_in_process() -> Iterator[None]:
    """The CLI's engine in this process (V1_MULTIPROCESSING=0): a core process would import
    torch and load whisper-base a second time, half of each run's CPU. The CLI over a core
    process is test_readme.py's `v1 transcribe` run."""
    from v1 import envs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(envs, "V1_MULTIPROCESSING", False)
        yield


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--language", "klingon"], "unknown language"),
        (["--temperature", "5"], "--temperature must be in [0, 2]"),
        (["--vad-parameters", "{bad"], "--vad-parameters must be a JSON object"),
        (["--beam-size", "0"], "beam_size must be an integer"),
        (["--suppress-tokens", "x"], "--suppress-tokens"),
        (["--max-initial-timestamp", "-1"], "max_initial_timestamp"),
    ],
)
def test_bad_options_fail_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    # The model does not exist: an error about it would mean the model was looked at first.
    code = main(["transcribe", str(SHORT), "--model", "/nonexistent/model", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "nonexistent" not in err


def test_wrong_task_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", str(SHORT), "--model", "/nonexistent/model", "--task", "summarize"])
    assert exit_info.value.code == 2 and "--task" in capsys.readouterr().err


@needs_assets(WHISPER_BASE, AUDIO)
def test_output_dir_gets_every_format_with_word_cues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "transcribe",
            str(SHORT),
            "--model",
            str(WHISPER_BASE),
            "--device",
            "cpu",
            "--language",
            "en",
            "--quiet",
            "--word-timestamps",
            "--beam-size",
            "1",
            "--prefix",
            "A man said",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"test_audio_0.{ext}" for ext in ("json", "srt", "tsv", "txt", "vtt")]
    txt = (tmp_path / "test_audio_0.txt").read_text()
    assert txt.startswith("A man said") and "universe" in txt
    srt = (tmp_path / "test_audio_0.srt").read_text()
    assert srt.count(" --> ") == len(txt.split())  # one cue per word
    vtt = (tmp_path / "test_audio_0.vtt").read_text()
    assert vtt.startswith("WEBVTT") and vtt.count(" --> ") == len(txt.split())
    tsv = (tmp_path / "test_audio_0.tsv").read_text().splitlines()
    assert tsv[0] == "start\tend\ttext" and tsv[1].split("\t")[2].startswith("A man said")
    data = json.loads((tmp_path / "test_audio_0.json").read_text())
    assert data["language"] == "english" and data["language_probability"] == 1.0
    assert all(0 < w["probability"] <= 1 for w in data["words"])
    assert "universe" in capsys.readouterr().out


@needs_assets(WHISPER_BASE, AUDIO)
def test_batch_transcribe_rows_carry_segments_language_and_words() -> None:
    from v1.__main__ import COMMANDS
    from v1.batch.cli import job_from_args
    from v1.batch.processor import BatchProcessor
    from v1.entrypoints.cli import make_parser

    args = make_parser(COMMANDS).parse_args(
        [
            "batch",
            "--task",
            "transcribe",
            "--model",
            str(WHISPER_BASE),
            "--input",
            "x",
            "--output",
            "y",
            "--language",
            "en",
            "--word-timestamps",
        ]
    )
    job = job_from_args(args, {})
    processor = BatchProcessor(
        "transcribe", str(WHISPER_BASE), {"device": "cpu"}, job.options, multiprocess=False
    )
    try:
        rows = processor({"id": [7], "path": [str(SHORT)]})
    finally:
        processor.shutdown()
    assert rows["language"] == ["en"] and rows["language_probability"] == [1.0]
    (segments,) = rows["segments"]
    assert segments and "universe" in segments[0]["text"]
    (words,) = rows["words"]
    assert "".join(w["word"] for w in words) == rows["text"][0]
    assert all(0 < w["probability"] <= 1 for w in words)
