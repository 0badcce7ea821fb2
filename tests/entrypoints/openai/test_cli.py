"""The `v1` command: engine flags generated from `engine_arg_fields()`, `v1 serve` binding only
127.0.0.1, and `v1 transcribe` / `v1 generate` / `v1 embed` run as subprocesses (all at once)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.entrypoints.openai.conftest import (
    AUDIO_DIR,
    MINILM_DIR,
    WHISPER_DIR,
    RemoteServer,
    v1_command,
)
from tests.utils import ASSETS, require_asset
from v1.config import engine_arg_fields
from v1.entrypoints.cli import attribute_docs, engine_kwargs, make_parser

pytestmark = pytest.mark.timeout(400)

SHORT = AUDIO_DIR / "librispeech" / "test_audio_0.flac"


def test_subcommands_and_engine_flags_help() -> None:
    parser = make_parser()
    help_text = parser.format_help()
    for command in ("serve", "transcribe", "generate", "embed"):
        assert command in help_text
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    serve_help = " ".join(serve.format_help().split())
    for owner, f in engine_arg_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.name == "hf_overrides":
            continue
        assert flag in serve_help, flag
        doc = attribute_docs(owner)[f.name]
        assert " ".join(doc.split()[:4]) in serve_help, (flag, doc)
    assert "--enforce-eager" in serve_help


def test_only_given_engine_flags_reach_the_engine() -> None:
    args = make_parser().parse_args(
        [
            "serve",
            "m",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    assert engine_kwargs(args) == {
        "block_size": 32,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.5,
    }
    assert args.host == "127.0.0.1" and args.port == 8000
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "m", "--block-size", "many"])


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of TCP sockets listening on `port` (from /proc/net/tcp*)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if int(port_hex, 16) == port and state == "0A":  # LISTEN
                out.append(address)
    return out


def test_serve_binds_only_localhost(llama_server: RemoteServer) -> None:
    addresses = _listening_addresses(llama_server.port)
    if not addresses:
        pytest.skip("/proc/net/tcp is not readable here")
    assert addresses == ["0100007F"]  # 127.0.0.1, never 0.0.0.0


@pytest.fixture(scope="module")
def runs(llama_server: RemoteServer) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Every CLI run of the module, started together (model loading dominates)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "V1_MULTIPROCESSING": "0", "V1_LOG_LEVEL": "ERROR"}
    commands = {
        "generate": ["generate", "--model", llama_server.model, "--max-tokens", "6", "the quick"],
        "bad-model": ["generate", "--model", "/nonexistent/model", "hi"],
    }
    if WHISPER_DIR.exists():
        commands["transcribe"] = [
            "transcribe",
            str(SHORT),
            "--model",
            str(WHISPER_DIR),
            "--language",
            "en",
            "--format",
            "srt",
        ]
    if MINILM_DIR.exists():
        commands["embed"] = ["embed", "--model", str(MINILM_DIR), "The new movie is awesome"]
    procs = {
        name: subprocess.Popen(
            [*v1_command(), *cmd, "--device", "cpu"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, cmd in commands.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    yield done


def test_generate_matches_the_server(
    runs: dict[str, subprocess.CompletedProcess], llama_server: RemoteServer
) -> None:
    run = runs["generate"]
    assert run.returncode == 0, run.stderr[-2000:]
    served = llama_server.openai().completions.create(
        model="tiny-llama", prompt="the quick", max_tokens=6, temperature=0.0
    )
    assert run.stdout.rstrip("\n") == served.choices[0].text


def test_bad_model_is_a_clean_error(runs: dict[str, subprocess.CompletedProcess]) -> None:
    run = runs["bad-model"]
    assert run.returncode == 2
    assert "v1 generate: error:" in run.stderr and "Traceback" not in run.stderr


def test_transcribe_srt(runs: dict[str, subprocess.CompletedProcess]) -> None:
    if "transcribe" not in runs:
        require_asset(ASSETS / "whisper-base")
    run = runs["transcribe"]
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().split("\n")
    assert lines[0] == "1" and " --> " in lines[1] and "," in lines[1]
    assert "man said to the universe" in " ".join(lines[2:]).lower()


def test_embed_prints_unit_vectors(runs: dict[str, subprocess.CompletedProcess]) -> None:
    if "embed" not in runs:
        require_asset(ASSETS / "all-MiniLM-L6-v2")
    run = runs["embed"]
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(run.stdout.strip())
    assert row["text"] == "The new movie is awesome"
    assert len(row["embedding"]) == 384
    assert np.linalg.norm(row["embedding"]) == pytest.approx(1.0, abs=1e-4)
