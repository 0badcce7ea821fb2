"""`v1 serve` subprocesses for the server tests: one per model for the whole directory, all
started together at the beginning of the session (startup is the slow part), each on 127.0.0.1
with a free port, stopped at the end. Tiny model folders are built here too.

No exit path leaves a server behind: the fixture stops them, an atexit hook covers an
interpreter that exits otherwise, and each server gets SIGTERM from the kernel when the test
process dies, even by SIGKILL (PR_SET_PDEATHSIG); its EngineCore follows its server.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import (
    ASSETS,
    make_tiny_llama_dir,
    make_tiny_model_dir,
    make_tiny_wordpiece_tokenizer,
    require_asset,
)

API_KEY = "test-key-123"
WHISPER_DIR = ASSETS / "whisper-base"
MINILM_DIR = ASSETS / "all-MiniLM-L6-v2"
AUDIO_DIR = ASSETS / "audio"
MAX_AUDIO_BYTES = 2_000_000
"""The Whisper server's upload cap (jfk.flac is 1.15 MB)."""
MAX_AUDIO_SECONDS = 900
"""The Whisper server's duration cap."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
TINY_BERT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
STARTUP_TIMEOUT_S = float(os.environ.get("V1_TEST_SERVER_STARTUP_S", "600"))
"""Upper bound only: readiness is polled, and a server that exits is reported at once."""
_PR_SET_PDEATHSIG = 1
_LIVE_SERVERS: set[RemoteServer] = set()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "uses_servers(*names): server fixtures a test gets through server_pool.get"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def v1_command() -> list[str]:
    """The `v1` console script of this interpreter (or the module behind it)."""
    script = Path(sys.executable).parent / "v1"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "v1.entrypoints.cli"]


class RemoteServer:
    """A `v1 serve` subprocess; its output goes to a log file shown when it fails to start."""

    def __init__(
        self,
        name: str,
        model: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = API_KEY if "--api-key" in args else None
        self.log_path = log_dir / f"{name}.log"
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "V1_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        cmd = [*v1_command(), "serve", model, "--port", str(self.port), "--device", "cpu", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        _LIVE_SERVERS.add(self)
        self._ready = False
        self._core_pid: int | None = None

    # ---- lifecycle ----
    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> RemoteServer:
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited early:\n{self.log_tail()}")
            try:
                ready = httpx.get(self.url + "/health", timeout=2).status_code == 200
                if ready:
                    with self.http(timeout=5) as client:
                        ready = client.get("/v1/models").status_code == 200
                if ready:
                    self._ready = True
                    self._core_pid = self.find_core_pid()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} server not ready in {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        _LIVE_SERVERS.discard(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        core = self._core_pid
        if core is not None and _alive(core) and _is_core_process(core):
            os.kill(core, signal.SIGKILL)  # the server died without stopping its core

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def find_core_pid(self) -> int:
        """The EngineCore process: the server's `python -m v1.engine.core_process` child."""
        for child in _children(self.proc.pid):
            if _is_core_process(child):
                return child
        raise RuntimeError(f"no EngineCore child under server pid {self.proc.pid}")

    # ---- clients ----
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), **kwargs)

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=kwargs.pop("timeout", 120),
            **kwargs,
        )

    def async_openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=kwargs.pop("timeout", 300),
            **kwargs,
        )

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}."""
        with self.http(timeout=30) as client:
            text = client.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, prefix: str) -> float:
        """Sum of the samples whose name (with labels) starts with `prefix`."""
        return sum(v for k, v in self.metrics().items() if k.startswith(prefix))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _is_core_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"v1.engine.core_process" in cmdline


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# ---- model folders ----
def make_chat_llama_dir(path: Path, chat_template: str | None) -> str:
    model_dir = make_tiny_llama_dir(path)
    config_path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config))
    (Path(model_dir) / "chat_template.jinja").unlink(missing_ok=True)
    return model_dir


def make_cross_encoder_dir(path: Path) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    make_tiny_wordpiece_tokenizer(path)
    return make_tiny_model_dir(
        BertConfig,
        BertForSequenceClassification,
        path,
        tokenizer_from=path,
        num_labels=1,
        **TINY_BERT,
    )


# ---- the servers ----
def _server_specs(root: Path) -> dict[str, Any]:
    """name -> a function that builds the model folder and returns (model, serve args)."""
    return {
        "llama_server": lambda: (
            make_chat_llama_dir(root / "llama", CHAT_TEMPLATE),
            [
                "--api-key",
                API_KEY,
                "--served-model-name",
                "tiny-llama",
                "tiny-llama-alias",
                "--num-kv-blocks",
                "96",
                "--max-num-seqs",
                "16",
                "--max-request-bytes",
                "12000000",
                "--max-tokens-per-request",
                "4096",
                "--header-timeout",
                "2",
                "--keep-alive-timeout",
                "2",
            ],
        ),
        "doomed_server": lambda: (
            make_chat_llama_dir(root / "llama_plain", None),
            [
                "--served-model-name",
                "doomed",
                "--num-kv-blocks",
                "64",
                "--max-pending",
                "2",
                "--keep-alive-on-engine-death",
            ],
        ),
        "whisper_server": lambda: (
            str(WHISPER_DIR),
            [
                "--served-model-name",
                "whisper-1",
                "--max-audio-bytes",
                str(MAX_AUDIO_BYTES),
                "--max-audio-seconds",
                str(MAX_AUDIO_SECONDS),
                "--audio-chunk-seconds",
                "30",  # every multi-window file goes through the chunked path
                "--max-num-seqs",
                "16",
            ],
        ),
        "minilm_server": lambda: (str(MINILM_DIR), ["--served-model-name", "minilm"]),
        "scorer_server": lambda: (
            make_cross_encoder_dir(root / "scorer"),
            ["--served-model-name", "scorer", "--max-num-batched-tokens", "256"],
        ),
    }


_NEEDS_ASSETS = {"whisper_server": WHISPER_DIR, "minilm_server": MINILM_DIR}


class ServerPool:
    """Starts servers on demand; `prestart` launches several at once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.specs = _server_specs(root)
        self.servers: dict[str, RemoteServer] = {}

    def start(self, name: str) -> RemoteServer:
        server = self.servers.get(name)
        if server is None:
            model, args = self.specs[name]()
            server = self.servers[name] = RemoteServer(name, model, args, self.root)
        return server

    def get(self, name: str) -> RemoteServer:
        missing = _NEEDS_ASSETS.get(name)
        if missing is not None:
            require_asset(missing)  # a skip locally, a failure under CI
        return self.start(name).wait_ready()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest) -> Iterator[ServerPool]:
    root = Path(tempfile.mkdtemp(prefix="v1_openai_"))
    pool = ServerPool(root)
    # Start every server some collected test needs, at once.
    wanted: set[str] = set()
    for item in request.session.items:
        wanted.update(getattr(item, "fixturenames", ()))
        for marker in item.iter_markers("uses_servers"):
            wanted.update(marker.args)
    for name in pool.specs:
        missing = _NEEDS_ASSETS.get(name)
        if name in wanted and (missing is None or missing.exists()):
            pool.start(name)
    try:
        yield pool
    finally:
        pool.stop_all()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def llama_server(server_pool: ServerPool) -> RemoteServer:
    return server_pool.get("llama_server")


@pytest.fixture(scope="session")
def whisper_server(server_pool: ServerPool) -> RemoteServer:
    return server_pool.get("whisper_server")


@pytest.fixture(scope="session")
def minilm_server(server_pool: ServerPool) -> RemoteServer:
    return server_pool.get("minilm_server")


@pytest.fixture(scope="session")
def scorer_server(server_pool: ServerPool) -> RemoteServer:
    return server_pool.get("scorer_server")


@pytest.fixture(scope="session")
def doomed_server(server_pool: ServerPool) -> RemoteServer:
    """A server the engine-death tests kill the core of (nothing else may use it)."""
    return server_pool.get("doomed_server")


def assert_error_body(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error shape with the expected status; returns the inner error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 1000
    assert isinstance(error["type"], str) and error["type"]
    assert not re.search(r"0x[0-9a-fA-F]{6,}", error["message"]), error  # no heap addresses
    return error
