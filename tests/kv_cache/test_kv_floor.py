"""The KV cache sits a floor below the core: no module of `v1/kv_cache` imports `v1.core` (it
reads requests through `KVRequest`), lazily or under TYPE_CHECKING included."""

from __future__ import annotations

import ast
from pathlib import Path

from v1.core.request import Request
from v1.kv_cache.kv_request import KVRequest
from v1.sampling_params import SamplingParams

KV_CACHE = Path(__file__).resolve().parents[2] / "v1" / "kv_cache"


def test_kv_cache_never_imports_the_core() -> None:
    offenders = []
    for path in sorted(KV_CACHE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("v1.core")]
    assert not offenders, offenders


def test_request_has_every_field_kv_request_names() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1))
    names = {n for n in vars(KVRequest) if not n.startswith("_")} | set(KVRequest.__annotations__)
    assert names == {
        "request_id",
        "all_token_ids",
        "num_computed_tokens",
        "block_hashes",
        "num_kv_slots",
        "num_tokens",
        "is_pooling",
        "encoder_hash",
        "num_encoder_tokens",
        "lora_int_id",
    }
    for name in names:
        getattr(request, name)  # raises AttributeError if Request lost one
