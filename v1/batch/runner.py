"""Runs a `BatchJob`: in this process with one engine, or over Ray Data with one engine per actor.

Either way: list the inputs, skip written shards, run the rest through `BatchProcessor` in
batches and write each shard once all its rows are back, in input order. Over Ray: read ->
`map_batches` (one engine per actor) -> the driver writes shards as their rows stream in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from v1.batch.job import BatchJob, list_inputs, num_shards, pending_shards, shard_path
from v1.batch.processor import BatchProcessor
from v1.batch.writer import read_shard, write_shard
from v1.logger import init_logger

logger = init_logger(__name__)

_RESULT_SKIP = ("index", "id", "path")
"""Bookkeeping columns a processor passes through; not written to the output."""


@dataclass(frozen=True)
class BatchReport:
    num_rows: int
    num_shards: int
    written: list[str]
    """Shards this run wrote."""
    num_skipped: int
    """Shards already written by an earlier run."""
    num_errors: int = 0
    """Rows this run wrote as error records (bad input, or the engine failed them)."""


def run_batch(job: BatchJob, *, use_tqdm: bool = True) -> BatchReport:
    if job.task == "openai":
        from v1.batch.openai_batch import read_requests

        rows = read_requests(job.input)
    else:
        rows = list_inputs(job)
    pending = pending_shards(job, rows)
    total = num_shards(len(rows), job.shard_size)
    if len(pending) < total:
        logger.info(
            "%d of %d shards already in %s: skipped", total - len(pending), total, job.output
        )
    written: list[str] = []
    if pending:
        shards = {k: rows[k * job.shard_size : (k + 1) * job.shard_size] for k in pending}
        progress = tqdm(
            total=sum(len(s) for s in shards.values()),
            unit="file" if job.task == "transcribe" else "row",
            desc=f"v1 batch {job.task}",
            disable=not use_tqdm,
        )
        with progress:
            if job.task == "openai":
                from v1.batch.openai_batch import run_openai_shards

                run = run_openai_shards
            else:
                run = _run_local if job.ray_address is None else _run_ray
            written = run(job, shards, progress)
    num_errors = sum(_count_errors(path) for path in written)
    if num_errors:
        logger.warning('%d row(s) failed: their records hold the reason in "error"', num_errors)
    return BatchReport(len(rows), total, written, total - len(pending), num_errors)


def _count_errors(path: str) -> int:
    return sum(1 for row in read_shard(path) if row.get("error"))


def _output_row(source: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A row's output record: its results, or {"id", "error"} when it failed."""
    error = source.get("error") or result.get("error")
    if error:
        return {"id": source["id"], "error": str(error)}
    skip = (*_RESULT_SKIP, "error")
    return {"id": source["id"], **{k: v for k, v in result.items() if k not in skip}}


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = dict.fromkeys(key for r in rows for key in r)
    return {key: [r.get(key) for r in rows] for key in keys}


def _rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(columns)
    return [dict(zip(keys, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def _run_local(job: BatchJob, shards: dict[int, list[dict[str, Any]]], progress: tqdm) -> list[str]:
    processor = BatchProcessor(job.task, job.model, job.engine_kwargs, job.options)
    written = []
    try:
        for k, shard in shards.items():
            out: list[dict[str, Any]] = []
            for start in range(0, len(shard), job.batch_size):
                chunk = shard[start : start + job.batch_size]
                results = _rows(processor(_columns(chunk)))
                out += [_output_row(src, res) for src, res in zip(chunk, results, strict=True)]
                progress.update(len(chunk))
            write_shard(shard_path(job, k), out, job.output_format)
            written.append(shard_path(job, k))
    finally:
        processor.shutdown()
    return written


class RayBatchProcessor:
    """`map_batches`' callable class: a BatchProcessor whose outputs keep the batch's index or
    path column (to find each row's shard) and leave as a pyarrow table (ragged lists are fine
    there)."""

    def __init__(self, **kwargs: Any) -> None:
        self.processor = BatchProcessor(**kwargs)

    def __call__(self, batch: dict[str, Any]) -> Any:
        import pyarrow as pa

        keys = [k for k in ("index", "path") if k in batch]
        inputs = dict(batch)
        inputs.setdefault("id", [str(x) for x in batch[keys[0]]])
        out = self.processor(inputs)
        for key in keys:
            out[key] = [x.item() if hasattr(x, "item") else x for x in batch[key]]
        return pa.table(out)


def _run_ray(job: BatchJob, shards: dict[int, list[dict[str, Any]]], progress: tqdm) -> list[str]:
    ray, use_gpu, num_actors = _ray_cluster(job)
    done: dict[int, list[tuple[int, dict[str, Any]]]] = {k: [] for k in shards}
    todo = []
    for k, shard in shards.items():
        for row in shard:
            if row.get("error"):  # known bad before any engine sees it
                done[k].append((row["index"], _output_row(row, {})))
                progress.update(1)
            else:
                todo.append(row)
    written: list[str] = []
    for k in list(done):
        if len(done[k]) == len(shards[k]):
            _write_done(job, k, done, written)
    if not todo:
        return sorted(written)
    ds, indices_of_path = _ray_inputs(ray, job, todo)
    ds = ds.map_batches(
        RayBatchProcessor,
        fn_constructor_kwargs={
            "task": job.task,
            "model": job.model,
            "engine_kwargs": job.engine_kwargs,
            "options": job.options,
            # A CPU actor's engine runs in the actor (its CPUs are the actor's); a GPU actor's
            # core gets its own process, so scheduling overlaps the device's work.
            "multiprocess": None if use_gpu else False,
        },
        batch_size=job.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_gpus=1 if use_gpu else 0,
        num_cpus=None if use_gpu else job.cpus_per_actor,
    )
    rows_by_index = {r["index"]: r for r in todo}
    for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        for result in table.to_pylist():
            if "index" in result:
                indices = [result["index"]]
            else:
                indices = indices_of_path[_norm(result["path"])]
            for index in indices:
                k = index // job.shard_size
                done[k].append((index, _output_row(rows_by_index[index], result)))
                progress.update(1)
                if len(done[k]) == len(shards[k]):
                    _write_done(job, k, done, written)
    if done:
        raise RuntimeError(f"Ray returned no rows for shards {sorted(done)}")
    return sorted(written)


def _ray_cluster(job: BatchJob) -> tuple[Any, bool, int]:
    """(ray, whether the actors take a GPU each, how many actors): Ray joined at
    `job.ray_address` (or started), its resources read once."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'v1-engine[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=job.ray_address)
        except ConnectionError as e:
            reason = str(e).splitlines()[0] if str(e) else "no answer"
            raise ValueError(
                f"--ray {job.ray_address}: no running Ray cluster ({reason.rstrip('.')}); start "
                "one with `ray start --head` (or give its address), or leave out --ray to run "
                "in this process"
            ) from None
    resources = ray.cluster_resources()
    use_gpu = job.engine_kwargs.get("device", "auto") != "cpu" and resources.get("GPU", 0) >= 1
    num_actors = job.num_actors or max(
        1,
        int(resources.get("GPU", 0))
        if use_gpu
        else int(resources.get("CPU", 1) // job.cpus_per_actor),
    )
    return ray, use_gpu, num_actors


def _ray_inputs(
    ray: Any, job: BatchJob, todo: list[dict[str, Any]]
) -> tuple[Any, dict[str, list[int]]]:
    """The rows to run as a Ray dataset, and (transcriptions) the row indices of each file."""
    indices_of_path: dict[str, list[int]] = {}
    if job.task != "transcribe":
        items = [{"index": r["index"], "text": r["text"]} for r in todo]
        return ray.data.from_items(items), indices_of_path
    # Ray reads the files where the actors run (no shared file system needed). Reading is
    # I/O: its tasks take no CPU slot, or actors holding every CPU would starve the read (and
    # wait for it forever). A file listed twice (JSONL) is read and transcribed once, its
    # result used for both.
    for r in todo:
        indices_of_path.setdefault(_norm(r["path"]), []).append(r["index"])
    paths = list(dict.fromkeys(r["path"] for r in todo))
    return ray.data.read_binary_files(paths, include_paths=True, num_cpus=0), indices_of_path


def _write_done(
    job: BatchJob, k: int, done: dict[int, list[tuple[int, dict[str, Any]]]], written: list[str]
) -> None:
    out = [row for _, row in sorted(done.pop(k), key=lambda item: item[0])]
    write_shard(shard_path(job, k), out, job.output_format)
    written.append(shard_path(job, k))


def _norm(path: str) -> str:
    return os.path.normpath(path).lstrip(os.sep)
