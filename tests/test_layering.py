"""Where code may depend on what (AST scans of the v1 package, and imports in a fresh process):
- `v1/core`, `v1/engine` and `v1/entrypoints` never import `v1.models` (model facts come from
  `ModelInfo`);
- model-kind branches (`is_whisper`, comparisons with `ModelKind`) live in the strategy
  packages (`v1/engine/inputs/`, `v1/worker/model_states/`), `v1/config.py` and
  `v1/model_info.py` only;
- importing `v1.audio` (as a text-only server does) loads neither torch nor an audio decoder.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "v1"

KIND_BRANCHES_ALLOWED = ("v1/engine/inputs/", "v1/worker/model_states/")
KIND_BRANCH_FILES_ALLOWED = ("v1/config.py", "v1/model_info.py")


def modules(*packages: str) -> Iterator[tuple[str, ast.Module]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def imported_modules(tree: ast.Module, path: str) -> Iterator[tuple[int, str]]:
    """Every module an import statement names, lazy ones inside functions included."""
    package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def kind_branches(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, enclosing qualified name) of each `is_whisper` read and each comparison with a
    `ModelKind` member."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        is_attr = isinstance(node, ast.Attribute)
        if is_attr and node.attr == "is_whisper" and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, ".".join(scope)))
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if any(
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "ModelKind"
                    for sub in ast.walk(side)
                ):
                    found.append((node.lineno, ".".join(scope)))
                    break
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return iter(found)


def test_core_engine_and_entrypoints_do_not_import_models() -> None:
    offenders = [
        f"{path}:{line} imports {name}"
        for path, tree in modules("v1/core", "v1/engine", "v1/entrypoints")
        for line, name in imported_modules(tree, path)
        if name == "v1.models" or name.startswith("v1.models.")
    ]
    assert offenders == []


def test_the_scans_see_what_they_look_for() -> None:
    """The scanners themselves: a lazy import of v1.models and both branch forms are found."""
    source = (
        "def f(mc):\n"
        "    from v1.models.bert import BertModel\n"
        "    if mc.kind == ModelKind.ENCODER_ONLY or mc.is_whisper:\n"
        "        return BertModel\n"
    )
    tree = ast.parse(source)
    assert "v1.models.bert.BertModel" in {n for _, n in imported_modules(tree, "v1/core/x.py")}
    assert list(kind_branches(tree)) == [(3, "f"), (3, "f")]
    relative = ast.parse("from ..models import bert\n")
    assert "v1.models.bert" in {n for _, n in imported_modules(relative, "v1/engine/x.py")}


def test_model_kind_branches_live_in_the_strategy_packages() -> None:
    sites = [
        (path, line, scope)
        for path, tree in modules("v1")
        for line, scope in kind_branches(tree)
        if not path.startswith(KIND_BRANCHES_ALLOWED) and path not in KIND_BRANCH_FILES_ALLOWED
    ]
    assert sites == [], "model-kind checks belong to an input builder or a model state"
    in_strategies = [
        path
        for path, tree in modules("v1/engine/inputs", "v1/worker/model_states")
        if list(kind_branches(tree))
    ]
    assert in_strategies  # the choice is made somewhere: by the strategy packages


def test_importing_audio_loads_no_torch_and_no_decoder() -> None:
    heavy = ("torch", "transformers", "soundfile", "av", "librosa", "soxr")
    script = (
        "import sys\n"
        "import v1.audio\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
        "import v1.entrypoints.openai.api_server\n"
        f"print(sorted(m for m in {heavy[2:]!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split("\n")
    assert out[0] == "[]", f"import v1.audio loaded {out[0]}"
    assert out[1] == "[]", f"the server module loaded audio decoders {out[1]}"
