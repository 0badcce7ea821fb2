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
