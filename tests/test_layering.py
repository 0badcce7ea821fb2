"""Where code may depend on what (AST scans of the v1 package, and imports in a fresh process):
- every package sits on a floor (FLOORS, stated once here) and imports only its own floor or lower,
  lazy and TYPE_CHECKING imports included: a lazy import hides a dependency, it does not remove it;
- the import graph of v1/ has no cycle, lazy imports included, so any module can be read, tested
  and moved with what it imports and nothing above it;
- `v1/core`, `v1/engine` and `v1/entrypoints` never import `v1.models` (model facts come from
  `ModelInfo`);
- model-kind branches (`is_whisper`, comparisons with `ModelKind`) live in the strategy
  packages (`v1/engine/inputs/`, `v1/worker/model_states/`), `v1/config/` (the model and
  engine configs) and `v1/model_info.py` only;
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

FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "v1.version",
        "v1.envs",
        "v1.logger",
        "v1.host_copy",
        "v1.gc_policy",
        "v1.forward_context",
        "v1.sampling_params",
        "v1.lora_request",
        "v1.pooling_params",
        "v1.structured_output",
        "v1.inputs",
        "v1.outputs",
        "v1.model_source",
        "v1.tokenizer",
        "v1.pooling_config",
        "v1.audio",
    ),
    ("v1.models.registry",),
    ("v1.config", "v1.model_info"),
    ("v1.kv_cache",),
    ("v1.core",),
    ("v1.quantization",),
    ("v1.attention",),
    ("v1.models",),
    ("v1.distributed", "v1.sample", "v1.lora"),
    ("v1.worker",),
    ("v1.executor",),
    ("v1.engine",),
    ("v1.entrypoints",),
    ("v1.batch",),
    ("v1",),  # the public API (v1/__init__.py) on top
)
"""Floors, low to high: a module imports only modules on its own floor or below."""

KIND_BRANCHES_ALLOWED = ("v1/engine/inputs/", "v1/worker/model_states/")
KIND_BRANCH_FILES_ALLOWED = ("v1/config/model.py", "v1/config/engine.py", "v1/model_info.py")


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


def module_name(path: str) -> str:
    """`v1/core/client.py` -> `v1.core.client`; a package's `__init__.py` -> the package."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def floor_of(module: str) -> int:
    """The floor of the longest FLOORS prefix naming `module` or a package above it."""
    best, best_len = -1, -1
    for floor, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = floor, len(prefix)
    assert best >= 0, f"{module} is on no floor"
    return best


def import_edges(tree: ast.Module, path: str, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, v1 module) for each v1 module an import statement depends on (lazy ones included):
    `from p import x` depends on `p.x` when that is a module, else on `p` itself. Packages passed
    through on the way to a submodule are no edges (an `__init__` is read on its own)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for end in range(len(parts), 0, -1):  # the longest known module it names
                    if ".".join(parts[:end]) in known:
                        yield node.lineno, ".".join(parts[:end])
                        break
        elif isinstance(node, ast.ImportFrom):
            base = next(iter(imported_modules(ast.Module([node], []), path)))[1]
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    yield node.lineno, f"{base}.{alias.name}"
                elif base in known:
                    yield node.lineno, base


def v1_import_graph(
    sources: dict[str, ast.Module] | None = None,
) -> dict[str, list[tuple[int, str]]]:
    """Module -> [(line, imported v1 module)], lazy and TYPE_CHECKING imports included."""
    if sources is None:
        sources = dict(modules("v1"))
    known = {module_name(path) for path in sources}
    return {
        module_name(path): sorted(set(import_edges(tree, path, known)))
        for path, tree in sources.items()
    }


def upward_imports(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [
        f"{module}:{line} imports {target} (floor {floor_of(module)} -> {floor_of(target)})"
        for module, edges in sorted(graph.items())
        for line, target in edges
        if floor_of(target) > floor_of(module)
    ]


def import_cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import), by Tarjan's
    algorithm, iterative so deep graphs do not hit the recursion limit."""
    succ = {m: sorted({t for _, t in edges if t in graph}) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in succ[node]:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_every_import_goes_to_its_own_floor_or_lower() -> None:
    assert upward_imports(v1_import_graph()) == []


def test_the_import_graph_has_no_cycle() -> None:
    assert import_cycles(v1_import_graph()) == []


def test_the_floor_and_cycle_scans_catch_a_planted_offender() -> None:
    """A core module that lazily imports an executor goes up a floor and closes a cycle with the
    executor's top-level import of the core; a name taken from a module is an edge to it."""
    sources = {
        "v1/core/a.py": ast.parse("def f():\n    from v1.executor.b import B\n"),
        "v1/executor/b.py": ast.parse("from v1.core.a import f\nclass B: ...\n"),
        "v1/envs.py": ast.parse(""),
    }
    graph = v1_import_graph(sources)
    assert graph["v1.executor.b"] == [(1, "v1.core.a")]
    assert upward_imports(graph) == ["v1.core.a:2 imports v1.executor.b (floor 4 -> 10)"]
    assert import_cycles(graph) == [["v1.core.a", "v1.executor.b"]]
    assert floor_of("v1.models.registry") < floor_of("v1.config") < floor_of("v1.models.bert")
    assert floor_of("v1") == len(FLOORS) - 1


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
