"""benchmarks/lora_bench.py on CPU at tiny size: every row (no LoRA in both cross-attention
modes, then 1 and 2 adapters) runs and forces its token count (the GPU run is the lead's)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from tests.utils import ASSETS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.skipif(not (ASSETS / "whisper-base").is_dir(), reason="needs whisper-base")
def test_tiny_lora_bench(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("lora_bench")
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--tiny", "--num-clips", "2", "--adapters", "1,2"]
    assert bench.main([*argv, "--tokenizer", str(ASSETS / "whisper-base"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["adapters"] for r in rows] == ["0 (auto)", 0, 1, 2]
    assert all(r["seconds"] > 0 and r["rtfx"] > 0 for r in rows)
