"""README's set-up commands and CI agree: `.ci/run` installs exactly as the README's test
command says (torch's CPU build from the PyTorch CPU index, then the package with its test
extras) and runs the same pytest command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def readme_commands() -> list[list[str]]:
    """Each bash block of the Set-up section, as its `&&`-separated commands."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Set-up") : readme.index("## Use")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return [[part.strip() for part in block.strip().split("&&")] for block in blocks]


def normalized(command: str) -> list[str]:
    words = shlex.split(command)
    if words[:3] == ["python3", "-m", "pip"]:
        words = ["pip", *words[3:]]
    return [w for w in words if w != "-q"]


def test_ci_runs_the_readme_test_command() -> None:
    install_and_run, install_and_test = readme_commands()
    for commands in (install_and_run, install_and_test):
        assert commands[0] == f"pip install torch==2.13.0 {CPU_INDEX}"
    ci = [
        line
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python3 -m")
    ]
    assert [normalized(c) for c in ci] == [normalized(c) for c in install_and_test]
