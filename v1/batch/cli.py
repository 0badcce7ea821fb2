"""`v1 batch`: the flags of an offline batch job and the command that runs it.

The flags build a `BatchJob` (v1.batch.job); the command hands it to the runner.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from v1.batch.job import OUTPUT_FORMATS, TASKS, BatchJob


def add_batch_parser(sub: Any, add_engine_args: Any) -> None:
    p = sub.add_parser(
        "batch",
        help="run an offline job over a corpus (here, or over a Ray cluster with --ray)",
        description="Transcribe audio files, or embed / complete the texts of a JSONL file, or "
        "answer an OpenAI Batch file (as vLLM's run-batch), into output shards "
        "(part-00000.jsonl, ...). A bad row becomes an error record with its id; the rest "
        "still runs. A restarted job skips the shards already written. With --ray the job runs "
        "over Ray Data, one engine per actor.",
    )
    p.add_argument("--input", required=True, help="audio directory / glob / file, or a .jsonl")
    p.add_argument("--output", required=True, help="output directory (one file per shard)")
    p.add_argument(
        "--task",
        default=None,
        choices=TASKS,
        help="what to run on each input; openai: an OpenAI Batch file (custom_id, method, url, "
        "body lines; the default when the input is one), answered as `v1 serve` would",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="openai: the `model` names the requests may use (default: the model argument)",
    )
    p.add_argument("--model", required=True, help="model folder or Hugging Face hub id")
    p.add_argument(
        "--format", default="jsonl", choices=OUTPUT_FORMATS, help="shard format (default: jsonl)"
    )
    p.add_argument("--shard-size", type=int, default=1000, help="rows per shard (default: 1000)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per engine call (default: 64)")
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run over a Ray cluster: host:port, ray://host:port or auto (needs v1-engine[ray])",
    )
    p.add_argument("--num-actors", type=int, default=None, help="Ray: engines to run")
    p.add_argument("--language", default=None, help="transcribe: spoken language (default: detect)")
    p.add_argument(
        "--translate", action="store_true", help="transcribe: translate to English instead"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="generate: tokens per prompt; transcribe: per 30 s window",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="generate: sampling temperature (default 0, greedy); transcribe: one temperature "
        "instead of the fallback schedule",
    )
    p.add_argument(
        "--timestamps",
        action="store_true",
        help="transcribe: rows carry timed segments and the language probability",
    )
    p.add_argument(
        "--word-timestamps",
        action="store_true",
        help="transcribe: rows carry segments and every word with its times and probability",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(p)


def job_from_args(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> BatchJob:
    from v1.batch.openai_batch import is_openai_batch_file

    task = args.task
    if task is None:
        if not is_openai_batch_file(args.input):
            raise ValueError(
                f"--task is needed: {args.input} is not an OpenAI Batch file (JSONL lines with "
                f"custom_id and body); tasks: {', '.join(TASKS)}"
            )
        task = "openai"
    options: dict[str, Any] = {}
    if task == "openai" and args.served_model_name:
        options["served_model_name"] = list(args.served_model_name)
    if task == "transcribe":
        if args.language is not None:
            options["language"] = args.language
        if args.translate:
            options["task"] = "translate"
        if args.temperature is not None:
            options["temperature"] = args.temperature
        if args.max_tokens is not None:
            options["max_tokens"] = args.max_tokens
        if getattr(args, "timestamps", False):
            options["timestamps"] = True
        if getattr(args, "word_timestamps", False):
            options["word_timestamps"] = True
    elif task == "generate":
        options["temperature"] = args.temperature if args.temperature is not None else 0.0
        if args.max_tokens is not None:
            options["max_tokens"] = args.max_tokens
    return BatchJob(
        input=args.input,
        output=args.output,
        task=task,
        model=args.model,
        engine_kwargs=engine_kwargs,
        options=options,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        output_format=args.format,
        ray_address=args.ray,
        num_actors=args.num_actors,
    )


def run_batch_command(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    from v1.batch.runner import run_batch

    report = run_batch(job_from_args(args, engine_kwargs), use_tqdm=not args.quiet)
    summary = {
        "output": args.output,
        "rows": report.num_rows,
        "shards": report.num_shards,
        "written": len(report.written),
        "skipped": report.num_skipped,
        "errors": report.num_errors,
    }
    print(json.dumps(summary), flush=True)
    if report.num_errors:
        print(
            f"v1 batch: {report.num_errors} row(s) failed; their output records hold the row's "
            'id and the reason in "error"',
            file=sys.stderr,
            flush=True,
        )
    return 0
