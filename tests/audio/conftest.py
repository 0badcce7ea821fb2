"""Shared fixtures for the audio tests: the real clips and model folder from ../shared/assets."""

from __future__ import annotations

from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[3] / "shared" / "assets"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared test asset {path} is absent (see shared/assets/README.md)")
    return path


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    """Folder of the real speech clips (jfk.flac, librispeech/, hotwords.mp3, ...)."""
    return _require(ASSETS / "audio")


@pytest.fixture(scope="session")
def whisper_base_dir() -> Path:
    """The openai/whisper-base transformers folder."""
    return _require(ASSETS / "whisper-base")
