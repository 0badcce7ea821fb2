"""Shared fixtures for the audio tests: the real clips and model folder from ../shared/assets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import ASSETS, require_asset

_require = require_asset


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    """Folder of the real speech clips (jfk.flac, librispeech/, hotwords.mp3, ...)."""
    return _require(ASSETS / "audio")


@pytest.fixture(scope="session")
def whisper_base_dir() -> Path:
    """The openai/whisper-base transformers folder."""
    return _require(ASSETS / "whisper-base")
