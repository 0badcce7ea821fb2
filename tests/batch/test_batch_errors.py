"""`v1 batch` never loses a corpus to one bad row: an empty text, a line that is not JSON, a row
without its input or a corrupt audio file becomes an error record with the row's id and the
reason (counted at the end); the other rows are written as before, and restarts still skip
written shards. `--ray auto` without a cluster is one line naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.batch.test_batch_local import (
    ENGINE_ARGS,
    PROMPTS,
    batch_args,
    expected,  # noqa: F401 - the module fixture
    inprocess_engines,  # noqa: F401 - autouse fixture
    read_output,
)
from tests.entrypoints.openai.conftest import AUDIO_DIR, WHISPER_DIR
from tests.utils import require_asset
from v1.__main__ import main
from v1.batch import BatchJob, run_batch

pytestmark = pytest.mark.timeout(300)


def bad_rows_file(path: Path) -> str:
    """PROMPTS as rows p0..p29, with three bad rows slipped in after p3, p10 and p20."""
    lines = []
    for i, p in enumerate(PROMPTS):
        lines.append(json.dumps({"id": f"p{i}", "text": p}))
        if i == 3:
            lines.append(json.dumps({"id": "empty", "text": ""}))
        if i == 10:
            lines.append("{this is not json")
        if i == 20:
            lines.append(json.dumps({"id": "typo", "txt": "no text key"}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_rows_become_error_records_and_the_rest_is_written(
    tiny_llama_dir: str,
    expected: list[dict],  # noqa: F811
    tmp_path: Path,
    capsys,
) -> None:
    inp, out = bad_rows_file(tmp_path / "in.jsonl"), tmp_path / "out"
    assert main(batch_args(inp, out, tiny_llama_dir)) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary == {
        "output": str(out),
        "rows": 33,
        "shards": 5,
        "written": 5,
        "skipped": 0,
        "errors": 3,
    }
    assert "3 row(s) failed" in captured.err
    rows = read_output(out)
    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert set(errors) == {"empty", "12", "typo"}  # the bad JSON line's id is its row number
    assert "empty" in errors["empty"]
    assert "line 13: not JSON" in errors["12"]
    assert "line 24: needs a string 'text or prompt'" in errors["typo"]
    assert [r for r in rows if "error" not in r] == expected

    # A restart still writes only the missing shard.
    (out / "part-00001.jsonl").unlink()
    assert main(batch_args(inp, out, tiny_llama_dir)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["written"], summary["skipped"]) == (1, 4)
    assert read_output(out) == rows


def test_parquet_shards_hold_error_records_too(tiny_llama_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"id": "a", "text": "fox"}) + "\n" + json.dumps({"id": "b", "text": ""}) + "\n"
    )
    job = BatchJob(
        input=str(inp),
        output=str(tmp_path / "out"),
        task="generate",
        model=tiny_llama_dir,
        engine_kwargs=ENGINE_ARGS,
        options={"temperature": 0.0, "max_tokens": 2},
        output_format="parquet",
    )
    report = run_batch(job, use_tqdm=False)
    assert report.num_errors == 1
    rows = read_output(tmp_path / "out")
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["error"] is None and len(rows[0]["token_ids"]) == 2
    assert rows[1]["error"] and rows[1]["text"] is None


def test_a_corrupt_audio_file_is_an_error_record(tmp_path: Path) -> None:
    require_asset(WHISPER_DIR)
    audio = tmp_path / "audio"
    audio.mkdir()
    (audio / "a_good.flac").write_bytes(
        (AUDIO_DIR / "librispeech" / "test_audio_0.flac").read_bytes()
    )
    (audio / "b_corrupt.wav").write_bytes(b"RIFF\x00\x00garbage, not audio")
    job = BatchJob(
        input=str(audio),
        output=str(tmp_path / "out"),
        task="transcribe",
        model=str(WHISPER_DIR),
        engine_kwargs={"device": "cpu"},
        options={"language": "en"},
    )
    report = run_batch(job, use_tqdm=False)
    assert report.num_errors == 1
    good, bad = read_output(tmp_path / "out")
    assert good["id"] == "a_good.flac" and "I exist" in good["text"]
    assert bad["id"] == "b_corrupt.wav" and set(bad) == {"id", "error"}
    assert "b_corrupt.wav" in bad["error"]


def _ray_cluster_running() -> bool:
    """A Ray GCS server on this machine (`ray start`, or one an earlier test left): then
    `--ray auto` legitimately finds it."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"gcs_server" in (entry / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


def test_ray_auto_without_a_cluster_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    if _ray_cluster_running():
        pytest.skip("a Ray cluster runs on this machine: --ray auto would join it")
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"text": "x"}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path / "ray")  # no cluster recorded there
    args = ["--input", str(inp), "--output", str(tmp_path / "out"), "--task", "embed"]
    run = subprocess.run(
        [sys.executable, "-m", "v1", "batch", *args, "--model", "m", "--ray", "auto", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=str(Path(__file__).parents[2]),
    )
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = [s for s in run.stderr.splitlines() if s.startswith("v1 batch: error:")]
    assert "no running Ray cluster" in line and "ray start --head" in line
    assert "Traceback" not in run.stderr
