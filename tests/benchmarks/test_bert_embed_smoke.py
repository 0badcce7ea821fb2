"""benchmarks/bert_embed.py on CPU: the real MiniLM folder and the random BERT-base through
transformers and our variants (before / after / flash), with the result file (the GPU run is
the lead's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import ASSETS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MINILM = ASSETS / "all-MiniLM-L6-v2"


@pytest.mark.slow  # two tiny workloads, transformers and two engines each: ~40 s on 2 cores
@pytest.mark.skipif(not MINILM.is_dir(), reason="needs ../shared/assets/all-MiniLM-L6-v2")
def test_tiny_bert_embed_run(tmp_path: Path) -> None:
    out = tmp_path / "bert.json"
    args = ["--device", "cpu", "--tiny", "--repeats", "1", "--inputs", "8"]
    args += ["--model", str(MINILM), "--json", str(out), "--variants", "before,after,flash"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bert_embed.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCHMARKS.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["workload"] for r in results] == ["all-MiniLM-L6-v2 (real)", "bert-base (random)"]
    for r in results:
        assert r["hf"]["tok_s"] > 0
        for label in ("before", "after", "flash"):
            # Same model, same inputs: our embeddings are transformers' (float32 on CPU).
            assert r[label]["min_cosine_to_hf"] > 0.9999
        assert r["before"]["flags"]["V1_FUSED_ENCODER"] is False
        assert r["flash"]["flags"]["V1_TRITON_ENCODER_ONLY"] is False
    assert "ours after" in done.stdout and "transformers batch 8" in done.stdout
