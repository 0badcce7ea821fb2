"""`make_frontend_and_client`: the frontend (tokenizer, processors) is built on a helper thread
while a core process starts; a frontend failure stops the core's start-up and is what the
caller sees; an in-process core starts after the frontend, on the caller's thread."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from v1 import LLM
from v1.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from v1.core.executor import Executor
from v1.engine.core_client import make_frontend_and_client

pytestmark = pytest.mark.timeout(120)


class NeverReadyExecutor(Executor):
    """Blocks its core's start-up for good: only an abort ends the wait for the handshake."""

    def __init__(self, config: EngineConfig) -> None:
        threading.Event().wait()


def _core_children() -> list[int]:
    """Live core processes started by this process."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == os.getpid() and state != "Z" and b"v1.engine.core_process" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def config(tiny_llama_dir: str) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model=tiny_llama_dir),
        cache_config=CacheConfig(block_size=4, num_kv_blocks=128),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )


def test_a_failing_frontend_aborts_a_core_that_never_gets_ready(config: EngineConfig) -> None:
    """Without the abort this test would wait for the handshake until its timeout."""
    before = set(_core_children())

    def build_frontend() -> None:
        raise ValueError("no tokenizer here")

    with pytest.raises(ValueError, match="no tokenizer here"):
        make_frontend_and_client(
            config,
            build_frontend,
            multiprocess=True,
            executor_factory=f"{__name__}:NeverReadyExecutor",
            ready_timeout_s=600,
        )
    assert set(_core_children()) <= before  # the started core was stopped


def test_the_frontend_is_built_while_the_core_process_starts(
    config: EngineConfig, tiny_llama_dir: str
) -> None:
    seen: dict[str, object] = {}

    def build_frontend() -> str:
        seen["thread"] = threading.current_thread().name
        if seen["thread"] != threading.main_thread().name:
            # The core process starts while the frontend is still being built (a frontend
            # built first, as before, would wait here in vain).
            deadline = time.monotonic() + 60
            while not _core_children() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["cores"] = _core_children()
        return "frontend"

    frontend, client = make_frontend_and_client(config, build_frontend, multiprocess=True)
    try:
        assert frontend == "frontend" and client.num_kv_blocks == 128
        assert seen["thread"] == "v1-frontend-start" and seen["cores"]
    finally:
        client.shutdown()

    frontend, client = make_frontend_and_client(config, build_frontend, multiprocess=False)
    try:
        assert frontend == "frontend" and seen["thread"] == threading.main_thread().name
    finally:
        client.shutdown()


def test_llm_without_tokenizer_files_is_a_value_error_and_leaves_no_core(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    before = set(_core_children())
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(tiny_llama_dir, tokenizer=str(empty), device="cpu", multiprocess=True)
    assert set(_core_children()) <= before
