"""OpenAI Batch files (as vLLM's `run-batch` reads and writes them): each input line is
{"custom_id", "method": "POST", "url", "body"}; each output line is {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}. Every request runs through the
OpenAI server's own app in this process (no socket: httpx's ASGI transport), so a body is
validated and answered exactly as `v1 serve` would; a bad line or request becomes that line's
error record and the rest of the shard runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any
from urllib.parse import unquote, urlparse

from tqdm.auto import tqdm

from v1 import envs
from v1.batch.job import BatchJob, shard_path
from v1.batch.writer import write_shard

URLS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)
"""Endpoints a batch line may name."""
_AUDIO_URLS = URLS[3:]
MAX_CONCURRENCY = 256
"""Requests of a shard in the engine at once (the scheduler batches them)."""


def is_openai_batch_file(path: str) -> bool:
    """The first non-empty line is an object with "custom_id" and "body"."""
    if not path.endswith(".jsonl") or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "custom_id" in obj and "body" in obj
    return False


def read_requests(path: str) -> list[dict[str, Any]]:
    """Rows {"index", "id" (custom_id), "request" (the line), and "error" for a line that is
    not a batch request}: the row keeps its place and gets an error record."""
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path!r}")
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            index = len(rows)
            row: dict[str, Any] = {"index": index, "id": f"line-{line_no}", "request": line}
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append({**row, "error": f"line {line_no}: not JSON: {e}"})
                continue
            if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
                row["id"] = obj["custom_id"]
            problem = _check_request(obj)
            if problem is not None:
                row["error"] = f"line {line_no}: {problem}"
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows


def _check_request(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return "a batch request must be a JSON object"
    if not isinstance(obj.get("custom_id"), str):
        return 'needs a string "custom_id"'
    if obj.get("method", "POST") != "POST":
        return f"method must be POST, got {obj.get('method')!r}"
    if obj.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}, got {obj.get('url')!r}"
    if not isinstance(obj.get("body"), dict):
        return 'needs an object "body"'
    if obj["body"].get("stream"):
        return "streaming is not supported in a batch"
    return None


class OpenAIBatchRunner:
    """One AsyncLLM behind the OpenAI app; `run_shard` answers a shard's lines in order."""

    def __init__(self, job: BatchJob) -> None:
        from v1.engine.async_llm import AsyncLLM
        from v1.entrypoints.openai.api_server import build_app
        from v1.entrypoints.openai.serving_engine import ServerSettings

        names = tuple(job.options.get("served_model_name") or (job.model,))
        self.engine = AsyncLLM(job.model, **job.engine_kwargs)
        try:
            settings = ServerSettings(
                served_model_names=names,
                model_path=job.model,
                max_pending=max(MAX_CONCURRENCY, envs.V1_MAX_PENDING_REQUESTS),
            )
            self.app = build_app(self.engine, settings)
        except BaseException:
            self.engine.shutdown()
            raise

    async def run_shards(
        self, job: BatchJob, shards: dict[int, list[dict[str, Any]]], progress: tqdm
    ) -> list[str]:
        """Answers each shard's lines (up to MAX_CONCURRENCY at once) and writes the shard."""
        import httpx

        limit = asyncio.Semaphore(MAX_CONCURRENCY)

        async def one(client: Any, row: dict[str, Any]) -> dict[str, Any]:
            async with limit:
                out = await self._answer(client, row)
            progress.update(1)
            return out

        written = []
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://v1-batch", timeout=None
        ) as client:
            for k, shard in shards.items():
                records = await asyncio.gather(*(one(client, row) for row in shard))
                write_shard(shard_path(job, k), list(records), "jsonl")
                written.append(shard_path(job, k))
        return written

    async def _answer(self, client: Any, row: dict[str, Any]) -> dict[str, Any]:
        if row.get("error"):
            return error_record(row["id"], 400, row["error"], "invalid_request_error")
        request = json.loads(row["request"])
        url, body = request["url"], request["body"]
        if url in _AUDIO_URLS:
            try:
                files, data = _audio_form(body)
            except ValueError as e:
                return error_record(row["id"], 400, str(e), "invalid_request_error")
            response = await client.post(url, files=files, data=data)
        else:
            response = await client.post(url, json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = {"text": response.text}
        if response.status_code == 200:
            return record(row["id"], 200, payload, None)
        error = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(error, dict):
            error = {"message": response.text, "type": "server_error"}
        return record(
            row["id"],
            response.status_code,
            payload,
            {"code": error.get("code") or error.get("type"), "message": error.get("message")},
        )

    def shutdown(self) -> None:
        self.engine.shutdown()


def record(
    custom_id: str, status_code: int, body: Any, error: dict[str, Any] | None
) -> dict[str, Any]:
    """One output line of the OpenAI Batch format."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": f"v1-batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": error,
    }


def error_record(custom_id: str, status_code: int, message: str, error_type: str) -> dict[str, Any]:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return record(custom_id, status_code, body, {"code": error_type, "message": message})


def _audio_form(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A transcription body -> multipart form: "file" (or "file_url") is a local path or a
    file:// URL, read here; the other fields go as form fields."""
    source = body.get("file", body.get("file_url"))
    if not isinstance(source, str):
        raise ValueError('an audio request needs "file" (a local path or file:// URL)')
    path = unquote(urlparse(source).path) if source.startswith("file://") else source
    try:
        with open(path, "rb") as f:
            audio = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the audio file {source!r}: {e.strerror}") from None
    data: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("file", "file_url"):
            continue
        if isinstance(value, list):
            data[key] = [str(v) for v in value]
        else:
            data[key] = json.dumps(value) if isinstance(value, dict | bool) else str(value)
            if isinstance(value, bool):
                data[key] = "true" if value else "false"
    return {"file": (os.path.basename(path), audio)}, data


def run_openai_shards(
    job: BatchJob, shards: dict[int, list[dict[str, Any]]], progress: tqdm
) -> list[str]:
    """Answers and writes each pending shard (one engine, one event loop for all)."""
    answerer = OpenAIBatchRunner(job)
    try:
        return asyncio.run(answerer.run_shards(job, shards, progress))
    finally:
        answerer.shutdown()
