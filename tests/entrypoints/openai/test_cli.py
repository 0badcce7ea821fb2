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
JFK = AUDIO_DIR / "jfk.flac"


def test_version_and_help_on_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    from v1 import __version__

    with pytest.raises(SystemExit) as info:
        make_parser().parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"v1-engine {__version__}\n"
    parser = make_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, (name, action.dest)
    flags = {name: set(sub._option_string_actions) for name, sub in commands.items()}
    # Each subcommand offers the engine flags that mean something to it.
    assert "--block-size" in flags["serve"] and "--block-size" not in flags["embed"]
    assert (
        "--enable-prefix-caching" not in flags["embed"] and "--max-model-len" in flags["generate"]
    )
    assert "--policy" in flags["serve"] and "--policy" not in flags["transcribe"]
    assert "--tokenizer" not in flags["transcribe"] and "--quiet" in flags["transcribe"]
    assert {"--device", "--dtype", "--max-num-seqs"} <= flags["embed"] & flags["transcribe"]


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
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files of the CLI runs: bad.wav is not audio, nope.wav does not exist."""
    path = tmp_path_factory.mktemp("cli")
    (path / "bad.wav").write_bytes(b"this is not audio at all " * 40)
    return path


@pytest.fixture(scope="module")
def runs(llama_server: RemoteServer, tmp: Path) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Every CLI run of the module, started together (model loading dominates)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "V1_MULTIPROCESSING": "0", "V1_LOG_LEVEL": "ERROR"}
    empty_hub = {"HF_HOME": str(tmp / "hf_home")}  # nothing cached
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "generate": (
            ["generate", "--model", llama_server.model, "--max-tokens", "6", "the quick"],
            {},
        ),
        "bad-model": (["generate", "--model", "/nonexistent/model", "hi"], {}),
        "offline-hub": (["transcribe", str(SHORT), "--model", "openai/whisper-base"], empty_hub),
        "unreachable-hub": (
            ["transcribe", str(SHORT), "--model", "openai/whisper-base"],
            {**empty_hub, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
        ),
    }
    if WHISPER_DIR.exists():
        whisper = ["--model", str(WHISPER_DIR), "--language", "en"]
        commands["transcribe"] = (["transcribe", str(SHORT), *whisper, "--format", "srt"], {})
        commands["transcribe-mixed"] = (
            ["transcribe", str(SHORT), str(tmp / "bad.wav"), str(JFK), *whisper, "--timestamps"],
            {},
        )
        commands["transcribe-verbose-json"] = (
            [
                "transcribe",
                str(SHORT),
                *whisper,
                "--format",
                "verbose_json",
                "--word-timestamps",
                "--quiet",
            ],
            {},
        )
        commands["transcribe-missing"] = (["transcribe", str(tmp / "nope.wav"), *whisper], {})
    if MINILM_DIR.exists():
        commands["embed"] = (["embed", "--model", str(MINILM_DIR), "The new movie is awesome"], {})
    procs = {
        name: subprocess.Popen(
            [*v1_command(), *cmd, "--device", "cpu"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, **extra_env},
        )
        for name, (cmd, extra_env) in commands.items()
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
    assert run.stderr.splitlines() == [
        "v1 generate: error: no such model folder: '/nonexistent/model'"
    ]


def test_a_hub_model_without_network_fails_at_once_in_one_line(
    runs: dict[str, subprocess.CompletedProcess],
) -> None:
    offline, unreachable = runs["offline-hub"], runs["unreachable-hub"]
    assert (offline.returncode, unreachable.returncode) == (2, 2)
    assert offline.stderr.splitlines() == [
        "v1 transcribe: error: cannot load model 'openai/whisper-base': no such local folder, "
        "not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
    ]
    assert unreachable.stderr.splitlines() == [
        "v1 transcribe: error: cannot load model 'openai/whisper-base': no such local folder, "
        "not in the Hugging Face cache, and the hub (http://127.0.0.1:9) is not reachable "
        "([Errno 111] Connection refused)"
    ]


def test_bad_audio_files_are_named_and_the_good_ones_still_print(
    runs: dict[str, subprocess.CompletedProcess], tmp: Path
) -> None:
    if "transcribe-mixed" not in runs:
        pytest.skip("whisper-base is absent")
    missing = runs["transcribe-missing"]
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.splitlines() == [
        f"v1 transcribe: error: {tmp}/nope.wav: no such file",
        f"v1 transcribe: error: 1 of 1 file(s) failed: {tmp}/nope.wav",
    ]
    mixed = runs["transcribe-mixed"]
    assert mixed.returncode == 1
    errors = mixed.stderr.splitlines()
    assert errors[0] == (
        f"v1 transcribe: error: {tmp}/bad.wav: could not decode audio: not a supported audio "
        "format, or corrupt (libsndfile: Format not recognised; ffmpeg: Invalid data found when "
        "processing input)"
    )
    assert errors[-1] == f"v1 transcribe: error: 1 of 3 file(s) failed: {tmp}/bad.wav"
    # The good files' transcripts, as openai-whisper's `[MM:SS.mmm --> MM:SS.mmm] text` lines
    # (--timestamps with text; hours only past the first hour).
    out = mixed.stdout.splitlines()
    assert out[:3] == [
        f"==> {SHORT} <==",
        "[00:00.000 --> 00:04.240] A man said to the universe, Sir, I exist.",
        f"==> {JFK} <==",
    ]
    assert out[3].startswith("[00:00.000 --> 00:") and "fellow Americans" in out[3]
    # Two files: a progress bar in audio seconds with the real-time factor.
    assert "Transcribing: 100%" in mixed.stderr and "15.7/15.7 s audio" in mixed.stderr
    assert "RTFx" in mixed.stderr


def test_verbose_json_has_segments(runs: dict[str, subprocess.CompletedProcess]) -> None:
    if "transcribe-verbose-json" not in runs:
        pytest.skip("whisper-base is absent")
    run = runs["transcribe-verbose-json"]
    assert run.returncode == 0, run.stderr[-2000:]
    body = json.loads(run.stdout)
    assert body["file"] == str(SHORT) and body["language"] == "english"
    ((segment),) = body["segments"]
    assert (segment["start"], segment["end"], segment["seek"]) == (0.0, 4.24, 0)
    assert segment["text"] == " A man said to the universe, Sir, I exist."
    assert segment["temperature"] == 0.0
    # --word-timestamps: the segment's words, in order, inside the audio (4.6 s).
    words = body["words"]
    assert " ".join(w["word"] for w in words) == "A man said to the universe, Sir, I exist."
    times = [t for w in words for t in (w["start"], w["end"])]
    assert times == sorted(times) and times[0] >= 0.0 and times[-1] <= 4.7


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
