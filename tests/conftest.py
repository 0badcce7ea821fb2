"""Suite-wide pytest set-up: no network (Hugging Face offline mode) and shared tiny models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `from tests.utils import ...` works under plain `pytest` too, not only `python -m pytest`.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402

from tests.utils import make_tiny_llama_dir, make_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A byte-level BPE tokenizer (vocab ~384, <s> prepended) saved in a temporary folder."""
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer GQA LlamaForCausalLM with the tiny tokenizer (read-only: copy it
    before changing files)."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def fresh_vad_threads(monkeypatch: pytest.MonkeyPatch):
    """A new VAD pool of 2 threads; yields the count of onnxruntime sessions created."""
    from v1.audio import vad

    created = [0]
    new_session = vad._new_session

    def counting() -> object:
        created[0] += 1
        return new_session()

    monkeypatch.setattr(vad, "_new_session", counting)
    monkeypatch.setattr(vad, "default_vad_workers", lambda: 2)
    monkeypatch.setattr(vad, "_pool", None)  # new threads: no session yet
    yield created
    pool, _ = vad.vad_pool()
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (tiny models: many small ops, faster on one
    thread, and the suite shares the cores); the module marks itself `ONE_TORCH_THREAD`."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
