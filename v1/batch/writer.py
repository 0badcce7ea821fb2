"""Writes one output shard (a list of row dicts) as JSONL or parquet, all at once: the shard
appears under its final name only when complete (temporary file, then one rename)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_shard(path: str, rows: list[dict[str, Any]], output_format: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if output_format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            # Error records have fewer columns: every row gets every column (None if absent).
            keys = dict.fromkeys(key for row in rows for key in row)
            uniform = [{key: row.get(key) for key in keys} for row in rows]
            pq.write_table(pa.Table.from_pylist(uniform), tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(path: str) -> list[dict[str, Any]]:
    """The rows of a shard `write_shard` wrote (either format)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
