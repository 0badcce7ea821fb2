"""The README's "Use" snippet as a new user runs it: saved as a file and run with `python
file.py` (no `__main__` guard, no `shutdown()`): exit 0, the expected output, nothing above
WARNING on stderr, no socket directory left behind. A script piped to `python -` works the same;
a SIGTERM to `v1 transcribe` mid-run removes its socket directory too."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import ASSETS

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(
        not (ASSETS / "whisper-base").is_dir() or not (ASSETS / "all-MiniLM-L6-v2").is_dir(),
        reason=f"needs the real whisper-base and MiniLM folders under {ASSETS}",
    ),
    pytest.mark.timeout(600),
]


def use_snippet() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Use") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README's Use section has no python block"
    return match.group(1)


def fresh_env(tmp_dir: Path) -> dict[str, str]:
    tmp_dir.mkdir()
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "TMPDIR": str(tmp_dir), "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}


def socket_dirs(tmp_dir: Path) -> list[str]:
    return sorted(p.name for p in tmp_dir.glob("v1-engine-*"))


def serious_lines(stderr: str) -> list[str]:
    """Lines above WARNING: errors, criticals, tracebacks."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith(("ERROR", "CRITICAL", "Traceback", "Exception"))
        or "Error:" in line
        or " ERROR " in line
    ]


STDIN_SCRIPT = """
from v1 import LLM

emb = LLM("../shared/assets/all-MiniLM-L6-v2")
print(len(emb.embed(["piped in on stdin"])[0].outputs.embedding))
"""


def test_readme_use_snippet_runs_as_a_file_and_a_script_runs_from_stdin(tmp_path: Path) -> None:
    snippet = use_snippet()
    ast.parse(snippet)
    script = tmp_path / "use.py"
    script.write_text(snippet)
    file_run = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO_ROOT,
        env=fresh_env(tmp_path / "tmp_file"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdin_run = subprocess.run(
        [sys.executable, "-"],
        cwd=REPO_ROOT,
        env=fresh_env(tmp_path / "tmp_stdin"),
        input=STDIN_SCRIPT,
        capture_output=True,
        text=True,
        timeout=500,
    )
    out, err = file_run.communicate(timeout=500)
    assert file_run.returncode == 0, err[-3000:]
    assert serious_lines(err) == [], err[-3000:]
    lines = out.splitlines()
    assert lines[0] == (
        " And so my fellow Americans, ask not what your country can do for you, ask what you "
        "can do for your country."
    )
    assert lines[1].startswith("[0.00 --> 11.00] And so my fellow Americans")
    embedding = ast.literal_eval(lines[-1])
    assert len(embedding) == 4 and all(isinstance(x, float) for x in embedding)
    assert socket_dirs(tmp_path / "tmp_file") == []
    # A script piped to `python -` (no file for a spawned child to re-import) works too.
    assert stdin_run.returncode == 0, stdin_run.stderr[-3000:]
    assert serious_lines(stdin_run.stderr) == []
    assert stdin_run.stdout == "384\n"
    assert socket_dirs(tmp_path / "tmp_stdin") == []


def test_sigterm_to_v1_transcribe_removes_the_socket_dir(tmp_path: Path) -> None:
    env = {**fresh_env(tmp_path / "tmp"), "V1_MULTIPROCESSING": "1"}
    jfk = str(ASSETS / "audio" / "jfk.flac")
    cli = subprocess.Popen(
        [sys.executable, "-m", "v1.entrypoints.cli", "transcribe", *[jfk] * 4]
        + ["--model", str(ASSETS / "whisper-base"), "--language", "en", "--device", "cpu"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stderr is not None
        for line in cli.stderr:  # wait until the core serves (the CLI is transcribing)
            if "EngineCore ready" in line:
                break
        else:
            pytest.fail(f"the CLI ended before its engine was ready (code {cli.wait()})")
        assert len(socket_dirs(tmp_path / "tmp")) == 1
        time.sleep(0.5)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert socket_dirs(tmp_path / "tmp") == []
