"""The ModelSpec rows: every row's classes import and match its kind, the config reads its
length and window rules from the row, and no code outside v1/models/ branches on a family."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from v1.config import ModelConfig
from v1.models import registry
from v1.models.registry import ModelKind

ROOT = Path(__file__).resolve().parents[2]
FAMILY_NAMES = {
    *(spec.family for spec in registry.SPECS),
    *(t for spec in registry.SPECS for t in spec.model_types),
    *registry.supported_architectures(),
    *("umt5", "camembert"),  # model types config.py once compared against
}


def _kind_of_class(cls: type) -> ModelKind:
    if not callable(getattr(cls, "compute_logits", None)):
        return ModelKind.ENCODER_ONLY
    if callable(getattr(cls, "encode", None)):
        return ModelKind.ENCODER_DECODER
    return ModelKind.DECODER_ONLY


@pytest.mark.parametrize("arch", registry.supported_architectures())
def test_every_architecture_has_a_row_whose_class_imports_and_matches_its_kind(arch: str) -> None:
    spec = registry.get_model_spec(arch)
    cls = registry.get_model_class(arch)
    assert _kind_of_class(cls) == spec.kind, f"{arch}: {cls.__name__} is not {spec.kind}"
    assert bool(spec.speech_tasks) == callable(getattr(cls, "alignment_attention", None))
    for model_type, default_arch in spec.model_types.items():
        assert default_arch in spec.classes, f"{spec.family}: {model_type} -> {default_arch}"


def test_rows_do_not_overlap_and_unknown_architectures_name_the_supported_ones() -> None:
    archs = [arch for spec in registry.SPECS for arch in spec.classes]
    assert len(archs) == len(set(archs))
    families = [spec.family for spec in registry.SPECS]
    assert len(families) == len(set(families))
    with pytest.raises(ValueError, match=r"'FooForCausalLM' is not supported.*BertModel"):
        registry.get_model_spec("FooForCausalLM")


def test_the_registry_and_the_config_import_no_torch() -> None:
    script = (
        "import sys, v1.models.registry, v1.config, v1.model_info; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


def model_config(hf_config: Any) -> ModelConfig:
    return ModelConfig(model="tiny", hf_config=hf_config)


@pytest.mark.parametrize(
    ("hf_config", "family", "decoder_len", "encoder_len"),
    [
        (transformers.T5Config(), "t5", None, 512),  # relative positions: unbounded decoder
        (transformers.WhisperConfig(), "whisper", 448, 1500),
        # RoBERTa positions start after the padding id: 514 - 1 - 1.
        (
            transformers.RobertaConfig(max_position_embeddings=514, pad_token_id=1),
            "roberta",
            None,
            512,
        ),
        (transformers.BertConfig(max_position_embeddings=256), "bert", None, 256),
        (transformers.BartConfig(max_position_embeddings=128), "bart", 128, 128),
        (transformers.LlamaConfig(max_position_embeddings=64), "llama", 64, 0),
    ],
    ids=["t5", "whisper", "roberta", "bert", "bart", "llama"],
)
def test_length_rules_come_from_the_row(
    hf_config: Any, family: str, decoder_len: int | None, encoder_len: int
) -> None:
    mc = model_config(hf_config)  # no `architectures`: the model_type names the row
    assert mc.spec.family == family
    if mc.kind != ModelKind.ENCODER_ONLY:
        assert mc.derived_max_model_len == decoder_len
    assert mc.max_encoder_len == encoder_len


def test_t5_encoder_row_pools_by_mean_and_needs_the_bias() -> None:
    cfg = transformers.T5Config(architectures=["T5EncoderModel"])
    mc = model_config(cfg)
    assert (mc.kind, mc.spec.pooling_modes) == (ModelKind.ENCODER_ONLY, ("mean",))
    assert mc.spec.attention_bias is not None
    assert mc.info.supported_tasks == {"embed", "score"}


# ---- no family branches outside v1/models/ ----


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            ids.add(id(first.value))
    return ids


def family_branches(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) of every `model_type` comparison and every family name used as a literal
    (a comparison, a collection of names, a dict key), docstrings and messages aside."""
    found: list[tuple[int, str]] = []
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(
                (isinstance(n, ast.Attribute) and n.attr == "model_type")
                or (isinstance(n, ast.Name) and n.id == "model_type")
                for s in sides
                for n in ast.walk(s)
            ):
                found.append((node.lineno, "model_type comparison"))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in ast.walk(node))
        is_name = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_name and id(node) not in skip and node.value in FAMILY_NAMES:
            found.append((node.lineno, repr(node.value)))
    return found


def test_no_family_branches_outside_models() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in sorted((ROOT / "v1").rglob("*.py"))
        if "v1/models/" not in path.as_posix()
        for line, what in family_branches(ast.parse(path.read_text()))
    ]
    assert offenders == [], "family facts belong to a ModelSpec row (v1/models/registry.py)"


def test_the_family_scan_sees_what_it_looks_for() -> None:
    source = (
        "def f(cfg):\n"
        '    """Whisper and "t5" in a docstring are fine."""\n'
        '    if cfg.model_type in ("t5", "mt5"):\n'
        "        return 1\n"
        '    names = {"BertModel": 1}\n'
        "    model_type = cfg.model_type\n"
        "    assert model_type != 3\n"
        '    raise ValueError(f"not {cfg.x} for t5")\n'
    )
    found = family_branches(ast.parse(source))
    assert sorted(found) == [
        (3, "'mt5'"),
        (3, "'t5'"),
        (3, "model_type comparison"),
        (5, "'BertModel'"),
        (7, "model_type comparison"),
    ]


def test_quantization_never_imports_the_models() -> None:
    """v1/quantization sits below v1/models: it finds layers by duck typing, and model classes
    declare their fp8 keep-lists (`default_fp8_ignore`)."""
    offenders = []
    for path in sorted((ROOT / "v1" / "quantization").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [
                f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("v1.models")
            ]
    assert offenders == []
