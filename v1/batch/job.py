"""An offline batch job: a task, a model with its engine arguments, inputs in a stable order,
and output shards of `shard_size` rows, each written in one rename (`OUTPUT/part-0000k.*`).

`OUTPUT/_job.json` records what the shards were made from: a restart skips written shards and
refuses different inputs or shard sizes instead of mixing them in.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

TASKS = ("transcribe", "embed", "generate", "openai")
"""openai: an OpenAI Batch file (requests to the server's endpoints; see openai_batch.py)."""
OUTPUT_FORMATS = ("jsonl", "parquet")
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm", ".aac")
MANIFEST = "_job.json"
_TEXT_KEYS = ("text", "prompt")
_AUDIO_KEYS = ("audio", "path")


@dataclass(frozen=True)
class BatchJob:
    """One offline job (`v1 batch` builds it from its flags)."""

    input: str
    """Audio: a directory (searched recursively), a glob or one file. Texts (and audio paths):
    a JSONL file of objects with "text" (or "prompt"; "audio" for transcribe) and optional "id"."""
    output: str
    """Directory the output shards go to (created if absent)."""
    task: str
    """transcribe (Whisper), embed (encoder-only embedding models), generate, or openai (an
    OpenAI Batch JSONL file of requests, answered by the server's endpoints)."""
    model: str
    """Model folder or hub id."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Engine arguments for every engine of the job (`LLM(model, **engine_kwargs)`)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Task options: `LLM.transcribe` keywords (language, task, temperature, ...; max_tokens:
    per 30 s window) for transcribe; SamplingParams fields (max_tokens, temperature, ...) for
    generate. JSON values only (they travel to Ray actors)."""
    shard_size: int = 1000
    """Rows per output shard (the unit a restarted job skips)."""
    batch_size: int = 64
    """Rows per engine call (and per Ray Data batch)."""
    output_format: str = "jsonl"
    """jsonl, or parquet (needs pyarrow)."""
    ray_address: str | None = None
    """None: one engine in this process. Otherwise a Ray cluster (an address, ray://..., or
    auto); an already initialized Ray session is used as is."""
    num_actors: int | None = None
    """Ray: engines (actors) to run; default one per GPU of the cluster, or one per CPU."""
    cpus_per_actor: float = 1.0
    """Ray: CPUs each CPU engine actor reserves (its torch threads)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output format must be jsonl or parquet, got {self.output_format!r}")
        for name in ("shard_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.task == "openai" and self.ray_address is not None:
            raise ValueError("OpenAI batch files run in this process: leave out --ray")
        if self.task == "openai" and self.output_format != "jsonl":
            raise ValueError("OpenAI batch output is JSONL: leave out --format parquet")
        if self.num_actors is not None and self.num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {self.num_actors}")
        if self.output_format == "parquet":
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise ValueError("parquet output needs pyarrow (pip install pyarrow)") from None

    @property
    def input_kind(self) -> str:
        """The row field an input fills: "path" (audio files), "request" (an OpenAI batch
        line) or "text"."""
        if self.task == "openai":
            return "request"
        return "path" if self.task == "transcribe" else "text"


def list_inputs(job: BatchJob) -> list[dict[str, Any]]:
    """Every input row, in a stable order: {"index", "id", and "path", "text" or "request";
    "error" for a row known bad}."""
    if job.task == "openai":
        raise ValueError("an OpenAI batch file's rows come from openai_batch.read_requests")
    if job.input.endswith(".jsonl"):
        return _read_jsonl(job)
    if job.task != "transcribe":
        raise ValueError(f"{job.task} reads a JSONL file of texts, got {job.input!r}")
    if os.path.isdir(job.input):
        root = job.input
        paths = [
            os.path.join(folder, name)
            for folder, _, names in os.walk(root)
            for name in names
            if name.lower().endswith(AUDIO_EXTENSIONS)
        ]
    else:
        root = os.path.dirname(job.input) or "."
        paths = [p for p in glob.glob(job.input, recursive=True) if os.path.isfile(p)]
    if not paths:
        raise ValueError(f"no audio files found at {job.input!r}")
    paths.sort()
    return [
        {"index": i, "id": os.path.relpath(p, root), "path": os.path.abspath(p)}
        for i, p in enumerate(paths)
    ]


def _read_jsonl(job: BatchJob) -> list[dict[str, Any]]:
    """The JSONL file's rows; a line that is not a usable row (not JSON, no input) becomes a row
    with its "error" (written as that row's error record; the others still run)."""
    if not os.path.isfile(job.input):
        raise ValueError(f"no such file: {job.input!r}")
    keys = _AUDIO_KEYS if job.input_kind == "path" else _TEXT_KEYS
    base = os.path.dirname(os.path.abspath(job.input))
    rows: list[dict[str, Any]] = []
    with open(job.input, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            index = len(rows)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append(_bad_row(job, index, str(index), f"line {line_no}: not JSON: {e}"))
                continue
            row_id = str(obj.get("id", index)) if isinstance(obj, dict) else str(index)
            key = next((k for k in keys if isinstance(obj, dict) and k in obj), None)
            if key is None or not isinstance(obj[key], str):
                reason = f"line {line_no}: needs a string {' or '.join(keys)!r}"
                rows.append(_bad_row(job, index, row_id, reason))
                continue
            value = obj[key]
            if job.input_kind == "path":
                value = os.path.join(base, value)  # absolute paths stay as they are
            rows.append({"index": index, "id": row_id, job.input_kind: value})
    if not rows:
        raise ValueError(f"{job.input} holds no rows")
    return rows


def _bad_row(job: BatchJob, index: int, row_id: str, reason: str) -> dict[str, Any]:
    return {"index": index, "id": row_id, job.input_kind: None, "error": reason}


def num_shards(num_rows: int, shard_size: int) -> int:
    return (num_rows + shard_size - 1) // shard_size


def shard_path(job: BatchJob, shard: int) -> str:
    return os.path.join(job.output, f"part-{shard:05d}.{job.output_format}")


def pending_shards(job: BatchJob, rows: list[dict[str, Any]]) -> list[int]:
    """Shards not written yet (after checking the output folder belongs to this job)."""
    _check_manifest(job, rows)
    return [
        k
        for k in range(num_shards(len(rows), job.shard_size))
        if not os.path.exists(shard_path(job, k))
    ]


def _check_manifest(job: BatchJob, rows: list[dict[str, Any]]) -> None:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(f"{row['id']}\0{row[job.input_kind]}\n".encode())
    manifest = {
        "task": job.task,
        "model": job.model,
        "num_rows": len(rows),
        "shard_size": job.shard_size,
        "output_format": job.output_format,
        "inputs_sha256": digest.hexdigest(),
    }
    os.makedirs(job.output, exist_ok=True)
    path = os.path.join(job.output, MANIFEST)
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
        if existing != manifest:
            changed = sorted(k for k in manifest if existing.get(k) != manifest[k])
            raise ValueError(
                f"{job.output} holds shards of another job (different {', '.join(changed)}); "
                "use a new output folder"
            )
        return
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)
