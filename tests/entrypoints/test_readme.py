"""The README's "Use" snippet as a new user runs it: saved as a file and run with `python
file.py` (no `__main__` guard, no `shutdown()`), and piped to `python -` on stdin. Both exit 0
with the expected output, print nothing above WARNING, and leave no socket directory behind;
a SIGTERM to `v1 transcribe` mid-run removes it too."""

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


def test_readme_use_snippet_runs_as_a_file_and_from_stdin(tmp_path: Path) -> None:
    snippet = use_snippet()
    ast.parse(snippet)
    script = tmp_path / "use.py"
    script.write_text(snippet)
    runs = {
        "file": subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO_ROOT,
            env=fresh_env(tmp_path / "tmp_file"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "stdin": subprocess.Popen(
            [sys.executable, "-"],
            cwd=REPO_ROOT,
            env=fresh_env(tmp_path / "tmp_stdin"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    outputs = {
        "file": runs["file"].communicate(timeout=500),
        "stdin": runs["stdin"].communicate(snippet, timeout=500),
    }
    for name, (out, err) in outputs.items():
        assert runs[name].returncode == 0, (name, err[-3000:])
        assert serious_lines(err) == [], (name, err[-3000:])
        lines = out.splitlines()
        assert lines[0] == (
            " And so my fellow Americans, ask not what your country can do for you, ask what you "
            "can do for your country."
        ), name
        assert lines[1].startswith("[0.00 --> ") and "fellow Americans" in lines[1], name
        embedding = ast.literal_eval(lines[-1])
        assert len(embedding) == 4 and all(isinstance(x, float) for x in embedding), name
        assert socket_dirs(tmp_path / f"tmp_{name}") == [], name


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
