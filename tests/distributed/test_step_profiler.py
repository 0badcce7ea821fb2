"""V1_TORCH_PROFILER_DIR: each tensor-parallel rank profiles a window of its steps and writes
a per-kernel table with the all-reduce share (the table behind issue 34's NCCL figure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.utils import make_tiny_llama_dir
from v1 import LLM, SamplingParams
from v1.worker.step_profiler import StepProfiler


def test_tp2_ranks_write_their_step_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "prof"
    monkeypatch.setenv("V1_TORCH_PROFILER_DIR", str(out))
    monkeypatch.setenv("V1_TORCH_PROFILER_STEPS", "2:5")
    path = make_tiny_llama_dir(tmp_path / "llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(
        path,
        multiprocess=False,
        tensor_parallel_size=2,
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=4,
    ) as llm:
        llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], params, use_tqdm=False)
    for rank in (0, 1):
        text = (out / f"rank{rank}.txt").read_text()
        head = text.splitlines()[0]
        assert head.startswith(f"steps 2:5, rank {rank};")
        share = float(re.search(r"\(([\d.]+)%\)", head).group(1))
        assert 0.0 < share < 100.0  # gloo's all_reduce ran inside the window, beside other ops
        assert "allreduce" in text


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="START < STOP"):
        StepProfiler("/tmp/x", 0, 5, 5)
