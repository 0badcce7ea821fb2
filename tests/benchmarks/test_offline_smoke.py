"""benchmarks/offline.py on CPU: every workload with tiny random models through both sides, the
output-size check, the roofline column and the result table (the GPU run is the lead's)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.utils import ASSETS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOKENIZERS = [
    "--tokenizer",
    str(ASSETS / "whisper-base"),
    "--bert-tokenizer",
    str(ASSETS / "all-MiniLM-L6-v2"),
]

pytestmark = pytest.mark.skipif(
    not (ASSETS / "whisper-base").is_dir() or not (ASSETS / "all-MiniLM-L6-v2").is_dir(),
    reason="needs the whisper-base and all-MiniLM-L6-v2 tokenizers in ../shared/assets",
)


@pytest.fixture(scope="module")
def offline() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("offline")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _smoke_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--tiny", "--in-process", *TOKENIZERS, *extra]


@pytest.mark.slow
def test_tiny_run_of_every_workload(
    offline: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path = tmp_path / "rows.json"
    # Two timed runs per figure, not the default three: still a median over fresh input sets
    # on both sides, and every paired row must honour the flag (a third run checks nothing more).
    argv = _smoke_args(
        tmp_path, "--check", "--workloads", "all", "--repeats", "2", "--json", str(rows_path)
    )
    assert offline.main(argv) == 0

    data = json.loads(rows_path.read_text())
    assert data["mismatches"] == [] and data["failures"] == []
    rows = {r["workload"]: r for r in data["rows"]}
    paired = ["whisper-large-v3-turbo", "whisper-large-v3", "bart-large", "bert-base"]
    paired.append(next(name for name in rows if name.startswith("llama-1b")))
    for name in paired:
        row = rows[name]
        assert len(row["ours"]["seconds"]) == 2 and row["ours"]["median"] > 0
        assert row["transformers"]["median"] > 0 and row["transformers_batch"] in (2, 4, 8)
        assert row["ratio"] > 0 and row["floor"] > 0 and row["ours_of_floor"] > 0
        assert any(note.startswith("check: both sides") for note in row["notes"]), name
    whisper_notes = " ".join(rows["whisper-large-v3-turbo"]["notes"])
    assert "GenerationMixin.generate" in whisper_notes and "model.generate" in whisper_notes
    assert "features" in whisper_notes
    step = next(r for name, r in rows.items() if name.startswith("whisper-turbo decode step"))
    # A difference of two timings (6 tokens - 1 token): for the tiny CPU model it is inside
    # the machine's noise and may come out negative; the smoke run checks it is measured.
    assert step["unit"] == "ms/step" and math.isfinite(step["ours"]["median"])
    assert len(step["ours"]["seconds"]) == 2 and step["floor"] > 0
    overhead = [r for name, r in rows.items() if name.startswith("host overhead")]
    assert len(overhead) == 2

    printed = capsys.readouterr().out
    assert "| workload | unit | v1-engine median [min-max]" in printed
    assert "Command: python3 benchmarks/offline.py --device cpu --tiny" in printed
    assert "Measured: GEMM" in printed and "check: every workload's output sizes agree" in printed


def test_check_fails_when_the_sides_disagree(
    offline: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' BERT side losing one input's embedding makes --check exit non-zero (and
    is only reported without --check)."""
    import _text

    real = _text._hf_embed

    def drops_last(*args: object, **kwargs: object) -> list[int]:
        return real(*args, **kwargs)[:-1] + [0]

    monkeypatch.setattr(_text, "_hf_embed", drops_last)
    argv = _smoke_args(tmp_path, "--workloads", "bert-base", "--repeats", "1")
    assert offline.main([*argv, "--check"]) == 1
    assert offline.main(argv) == 0


def test_roofline_turbo_step_reads_cross_kv_of_the_batch(offline: ModuleType) -> None:
    """Issue 20's figure: a turbo decode step at batch 256 must read ~7.9 GB of cross K/V
    (4 layers x K, V x 1500 x 1280 fp16 per request) plus the decoder weights and LM head."""
    from _roofline import EncDecShape, enc_dec_step_cost

    turbo = EncDecShape(1280, 32, 4, 5120, 51866, 1500, mel_bins=128)
    cross_kv = 256 * 4 * 2 * 1500 * 1280 * 2
    weights = (4 * (6 * 1280**2 + 2 * 1280 * 5120) + 51866 * 1280) * 2
    cost = enc_dec_step_cost(turbo, batch=256, position=0)
    assert cost.bytes == cross_kv + weights + 256 * 4 * 2 * 1280 * 2
    assert cost.flops < 0.2e12  # a decode step is memory-bound: ~0.1 TFLOP for ~8 GB


def test_engine_memory_is_released_between_variants(
    offline: ModuleType, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-process engine's weights are freed once its variant is done (LLM freezes the GC at
    start-up, so without the harness's unfreeze its cycles would keep them until exit)."""
    import argparse
    import weakref

    import _context
    from _harness import Device

    from v1 import LLM, SamplingParams

    weights: list[weakref.ref] = []
    real_init = LLM.__init__

    def init(self: LLM, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)
        runner = self.llm_engine.engine_core.engine_core.executor.worker.model_runner
        weights.extend(weakref.ref(p) for p in runner.model.parameters())

    monkeypatch.setattr(LLM, "__init__", init)
    args = argparse.Namespace(repeats=1, multiprocess=False)
    ctx = _context.Context(args, Device("cpu"), None, [{}], _context.ModelStore())
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    result = _context.run_ours(
        ctx,
        tiny_llama_dir,
        {"kv_cache_memory_bytes": 16 << 20},
        {},
        lambda input_set: [{"prompt_token_ids": [5 + input_set, 6, 7]}] * 2,
        lambda llm, prompts: llm.generate(prompts, params, use_tqdm=False),
    )
    assert result.error is None and len(result.samples) == 1
    assert result.probe.counts == [3, 3]
    assert weights and all(ref() is None for ref in weights)


def test_settings_and_process_rows(offline: ModuleType, tmp_path: Path) -> None:
    """`--settings tuned,defaults --process mp`: two rows of one workload, both with the core in
    its own process; the defaults row says that it ran without the workload's settings."""
    rows_path = tmp_path / "rows.json"
    argv = _smoke_args(tmp_path, "--workloads", "whisper-turbo", "--no-transformers")
    argv += ["--repeats", "1", "--settings", "tuned,defaults", "--process", "mp"]
    assert offline.main([*argv, "--json", str(rows_path)]) == 0
    rows = json.loads(rows_path.read_text())["rows"]
    names = [r["workload"] for r in rows]
    assert names == [
        "whisper-large-v3-turbo [process=mp]",
        "whisper-large-v3-turbo [settings=defaults, process=mp]",
    ]
    for row in rows:
        defaults = any("only LLM's defaults" in n for n in row["notes"])
        assert defaults == ("settings=defaults" in row["workload"])
        assert row["ours"] is not None
