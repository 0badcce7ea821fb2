"""Fixtures shared by the transcription planner tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.utils import make_tiny_whisper_dir
from v1.config import ModelConfig
from v1.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def aligned_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Any]:
    """The tiny model with alignment heads inside its 2-layer decoder (word timestamps)."""
    path = make_tiny_whisper_dir(Path(tmp_path_factory.mktemp("tiny_aligned")))
    config_file = Path(path) / "generation_config.json"
    generation = json.loads(config_file.read_text())
    generation["alignment_heads"] = [[1, 0], [1, 2]]
    config_file.write_text(json.dumps(generation))
    config = ModelConfig(path)
    return config, get_tokenizer(config)
