"""A model that cannot be loaded fails in `LLM(...)` at once, with one line saying why: a
missing folder, a file, a hub repo that is not cached while offline or while the hub cannot be
reached (a closed local port stands in for a network that is down)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from v1 import LLM


@pytest.fixture
def empty_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")


def load_error(model: str, **kwargs: object) -> str:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        LLM(model, device="cpu", multiprocess=False, **kwargs)
    assert time.monotonic() - start < 10, "no retries, no model loading"
    return str(info.value)


def test_missing_folders_and_files_are_named(tmp_path: Path) -> None:
    assert load_error("/nonexistent/model") == "no such model folder: '/nonexistent/model'"
    assert load_error("./models/whisper") == "no such model folder: './models/whisper'"
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert load_error(str(weights)) == (
        f"model '{weights}' is a file, not a folder: give the model's folder"
    )


def test_hub_ids_fail_fast_without_a_network(empty_hub: None, monkeypatch) -> None:
    assert load_error("openai/whisper-base") == (
        "cannot load model 'openai/whisper-base': no such local folder, not in the Hugging Face "
        "cache, and the hub (http://127.0.0.1:9) is not reachable ([Errno 111] Connection "
        "refused)"
    )
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert load_error("openai/whisper-base") == (
        "cannot load model 'openai/whisper-base': no such local folder, not in the Hugging Face "
        "cache, and HF_HUB_OFFLINE is set"
    )


def test_the_tokenizer_is_checked_too(empty_hub: None, tmp_path: Path) -> None:
    from tests.utils import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path / "llama")
    assert (
        load_error(model, tokenizer="/no/tokenizer") == "no such tokenizer folder: '/no/tokenizer'"
    )
