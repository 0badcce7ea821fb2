"""The selector: each rejection reason, forcing a backend, the errors; and a scan that no code
outside v1/attention/ tests a backend's name or a backend's metadata type."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from v1.attention import selector
from v1.attention.backend import AttentionType, BackendCapabilities
from v1.attention.backends.torch_sdpa import TorchSDPABackend
from v1.attention.selector import AttentionNeeds, rejection, select_backend

ROOT = Path(__file__).resolve().parents[2]
CPU_DECODER = AttentionNeeds(frozenset({AttentionType.DECODER}), "cpu")


def fake(**caps: object) -> type:
    return type(
        "Fake", (TorchSDPABackend,), {"name": "fake", "capabilities": BackendCapabilities(**caps)}
    )


@pytest.mark.parametrize(
    ("caps", "needs", "reason"),
    [
        ({"device_types": frozenset({"cuda"})}, {}, "runs on cuda, not cpu"),
        (
            {"min_compute_capability": (9, 0)},
            {"device_type": "cuda", "compute_capability": (8, 0)},
            "needs compute capability sm_90, device has sm_80",
        ),
        ({"required_packages": ("no_such_package_xyz",)}, {}, "no_such_package_xyz package"),
        (
            {"attn_types": frozenset({AttentionType.DECODER})},
            {"attn_types": frozenset({AttentionType.DECODER, AttentionType.ENCODER})},
            "no metadata for encoder attention",
        ),
        ({"encoder_states": False}, {"encoder_states": True}, "no encoder-states metadata"),
        ({}, {"bias": True}, "no additive attention bias"),
        ({}, {"fp8_kv_cache": True}, "no fp8 KV cache"),
        (
            {"fp8_kv_cache": True, "fp8_min_compute_capability": (8, 9)},
            {"fp8_kv_cache": True, "device_type": "cuda", "compute_capability": (8, 0)},
            "fp8 KV cache needs compute capability sm_89",
        ),
        ({"block_size_multiple": 256}, {"block_size": 16}, "not a multiple of 256"),
    ],
)
def test_each_rejection_reason(caps: dict, needs: dict, reason: str) -> None:
    backend = fake(**caps)
    assert reason in rejection(backend, dataclasses.replace(CPU_DECODER, **needs))


def test_bias_is_served_materialized_or_in_kernel() -> None:
    needs = dataclasses.replace(CPU_DECODER, bias=True)
    assert rejection(fake(materialized_bias=True), needs) is None
    assert rejection(fake(in_kernel_bias=True), needs) is None


def test_auto_takes_the_first_backend_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selector, "load_backend", lambda name: backends[name])
    backends = {
        "gpu_only": fake(device_types=frozenset({"cuda"})),
        "no_bias": fake(),
        "biased": fake(materialized_bias=True),
    }
    monkeypatch.setattr(selector, "_BACKENDS", dict.fromkeys(backends, ""))
    assert select_backend(CPU_DECODER) is backends["no_bias"]
    assert select_backend(dataclasses.replace(CPU_DECODER, bias=True)) is backends["biased"]
    with pytest.raises(ValueError) as e:
        select_backend(dataclasses.replace(CPU_DECODER, bias=True, fp8_kv_cache=True))
    assert str(e.value) == (
        "no attention backend serves this model on cpu: gpu_only: runs on cuda, not cpu; "
        "no_bias: takes no additive attention bias; biased: has no fp8 KV cache"
    )


def test_cpu_picks_torch_sdpa_and_a_forced_backend_must_fit() -> None:
    assert select_backend(CPU_DECODER) is TorchSDPABackend
    assert select_backend(CPU_DECODER, forced="torch_sdpa") is TorchSDPABackend
    with pytest.raises(ValueError, match="attention_backend='triton' cannot serve this model"):
        select_backend(CPU_DECODER, forced="triton")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend(CPU_DECODER, forced="nope")


def test_the_config_knows_every_backend() -> None:
    """CacheConfig checks attention_backend against the selector's names (config cannot import
    the selector: it sits floors below)."""
    from v1.config import ATTENTION_BACKENDS

    assert set(ATTENTION_BACKENDS) == {"auto", *selector._BACKENDS}


def test_import_failure_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(selector._BACKENDS, "broken", "no_such_module_xyz:Backend")
    with pytest.raises(ValueError, match="'broken' cannot serve this model: cannot be imported"):
        select_backend(CPU_DECODER, forced="broken")


def test_attention_backend_setting_reaches_the_runner(tiny_llama_dir: str) -> None:
    from v1.config import make_engine_config
    from v1.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match="unknown engine argument"):
        make_engine_config(tiny_llama_dir, attention_backnd="triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        make_engine_config(tiny_llama_dir, device="cpu", attention_backend="trition")
    config = make_engine_config(tiny_llama_dir, device="cpu", attention_backend="flash_attn")
    assert config.cache_config.attention_backend == "flash_attn"
    import torch

    with pytest.raises(ValueError, match="attention_backend='flash_attn' cannot serve"):
        ModelRunner(config, torch.device("cpu"))


# ---- outside v1/attention, nothing asks which backend it is ----

BACKEND_NAMES = set(selector._BACKENDS)
METADATA_CLASSES = {
    node.name
    for path in (ROOT / "v1/attention/backends").glob("*.py")
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.ClassDef) and node.name.endswith("Metadata")
}
"""Every registered backend's name and every metadata class the backends define."""


def offenses(tree: ast.AST) -> list[tuple[int, str]]:
    """Comparisons with a backend-name string literal, and isinstance checks naming a backend
    metadata class (or reading `backend_name`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in BACKEND_NAMES:
                    found.append((node.lineno, f"compares with {side.value!r}"))
                if isinstance(side, ast.Attribute) and side.attr in ("backend_name", "name"):
                    names = [
                        s.value
                        for s in (node.left, *node.comparators)
                        if isinstance(s, ast.Constant) and isinstance(s.value, str)
                    ]
                    if side.attr == "backend_name" or set(names) & BACKEND_NAMES:
                        found.append((node.lineno, f"compares .{side.attr}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
        ):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & METADATA_CLASSES:
                found.append(
                    (node.lineno, f"isinstance against {sorted(names & METADATA_CLASSES)}")
                )
    return found


def test_no_backend_name_or_metadata_type_tests_outside_attention() -> None:
    bad = []
    for path in sorted((ROOT / "v1").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("v1/attention/"):
            continue
        for line, what in offenses(ast.parse(path.read_text(), rel)):
            bad.append(f"{rel}:{line} {what}")
    assert not bad, "ask the backend's capabilities instead:\n" + "\n".join(bad)


def test_the_scan_finds_what_it_forbids() -> None:
    source = (
        'if backend_name == "triton": pass\n'
        "if isinstance(md, SDPAMetadata): pass\n"
        'if self.attn_metadata.backend_name != "x": pass\n'
    )
    assert [line for line, _ in offenses(ast.parse(source))] == [1, 2, 3]
