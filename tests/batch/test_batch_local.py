"""`v1 batch` on one machine (no Ray): outputs equal `LLM`'s, shards are resumable, the output
folder is tied to its job, and inputs are listed in a stable order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from v1 import envs
from v1.__main__ import main
from v1.batch import BatchJob, run_batch
from v1.batch.job import list_inputs
from v1.batch.writer import read_shard
from v1.entrypoints.llm import LLM
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

ENGINE_ARGS = {"device": "cpu", "num_kv_blocks": 256}
PROMPTS = [f"{word} number {i}" for i, word in enumerate(["fox", "dog", "cat"] * 10)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_output(folder: Path) -> list[dict]:
    parts = sorted(p for p in os.listdir(folder) if p.startswith("part-"))
    return [row for p in parts for row in read_shard(str(folder / p))]


@pytest.fixture(autouse=True)
def inprocess_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs' engines run in this process (a core process per job only adds start-up)."""
    monkeypatch.setattr(envs, "V1_MULTIPROCESSING", False)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str) -> list[dict]:
    with LLM(tiny_llama_dir, multiprocess=False, **ENGINE_ARGS) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    return [
        {"id": f"p{i}", "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
        for i, o in enumerate(outputs)
    ]


def batch_args(inp: str, out: Path, model: str, *extra: str) -> list[str]:
    return [
        "batch",
        *("--input", inp, "--output", str(out), "--task", "generate", "--model", model),
        *("--max-tokens", "4", "--shard-size", "8", "--batch-size", "5", "--quiet"),
        *("--device", "cpu", "--num-kv-blocks", "256", *extra),
    ]


def test_cli_job_matches_llm_and_resumes_by_shard(
    tiny_llama_dir: str, expected: list[dict], tmp_path: Path, capsys
):
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    )
    out = tmp_path / "out"
    assert main(batch_args(inp, out, tiny_llama_dir)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {
        "output": str(out),
        "rows": 30,
        "shards": 4,
        "written": 4,
        "skipped": 0,
        "errors": 0,
    }
    assert read_output(out) == expected

    # A restart writes only the missing shard; shards already there are left as they are.
    (out / "part-00002.jsonl").unlink()
    marker = (out / "part-00000.jsonl").read_text().replace('"p0"', '"kept"')
    (out / "part-00000.jsonl").write_text(marker)
    assert main(batch_args(inp, out, tiny_llama_dir)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["written"] == 1 and summary["skipped"] == 3
    rows = read_output(out)
    assert rows[0]["id"] == "kept" and rows[1:] == expected[1:]

    # Another job's settings over the same folder are refused, not mixed in.
    assert main(batch_args(inp, out, tiny_llama_dir, "--shard-size", "5")) == 2
    assert "different shard_size" in capsys.readouterr().err


def test_parquet_output_holds_the_same_rows(tiny_llama_dir: str, expected: list[dict], tmp_path):
    pytest.importorskip("pyarrow")
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"id": f"p{i}", "text": p} for i, p in enumerate(PROMPTS)]
    )
    job = BatchJob(
        input=inp,
        output=str(tmp_path / "out"),
        task="generate",
        model=tiny_llama_dir,
        engine_kwargs=ENGINE_ARGS,
        options={"temperature": 0.0, "max_tokens": 4},
        shard_size=16,
        output_format="parquet",
    )
    report = run_batch(job, use_tqdm=False)
    assert report.num_shards == 2 and [os.path.basename(p) for p in report.written] == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert read_output(tmp_path / "out") == expected


def test_inputs_are_listed_in_a_stable_order_and_bad_input_is_a_value_error(tmp_path: Path):
    audio = tmp_path / "audio"
    (audio / "b").mkdir(parents=True)
    for name in ("b/2.flac", "1.wav", "b/0.mp3", "notes.txt"):
        (audio / name).write_bytes(b"x")
    job = BatchJob(input=str(audio), output=str(tmp_path / "o"), task="transcribe", model="m")
    rows = list_inputs(job)
    assert [r["id"] for r in rows] == ["1.wav", "b/0.mp3", "b/2.flac"]
    assert [r["index"] for r in rows] == [0, 1, 2] and all(os.path.isabs(r["path"]) for r in rows)
    globbed = BatchJob(**{**job.__dict__, "input": str(audio / "b" / "*.flac")})
    assert [r["id"] for r in list_inputs(globbed)] == ["2.flac"]

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"id": "t", "txt": "typo"}])
    rows = list_inputs(BatchJob(input=bad, output=str(tmp_path / "o"), task="embed", model="m"))
    assert rows[1] == {  # a bad row keeps its place and id; its record will be an error
        "index": 1,
        "id": "t",
        "text": None,
        "error": "line 2: needs a string 'text or prompt'",
    }
    with pytest.raises(ValueError, match="reads a JSONL file"):
        list_inputs(BatchJob(input=str(audio), output=str(tmp_path / "o"), task="embed", model="m"))
    with pytest.raises(ValueError, match="task must be one of"):
        BatchJob(input="x", output="y", task="summarize", model="m")
