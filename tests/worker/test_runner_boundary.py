"""The runner is the only owner of its attributes: nothing outside v1/worker/model_runner.py (and
the Worker that owns the runner) reads them, no module but the Worker imports it, the model-kind
states never see the CUDA graphs (the runner alone chooses graph or eager), and neither the
states nor the graph manager is built from the runner."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import v1
from v1.worker.cuda_graphs import CudaGraphManager
from v1.worker.model_states.base import ModelState, StateContext

V1 = Path(v1.__file__).parent
RUNNER_NAMES = {"runner", "model_runner", "ModelRunner"}
OWNERS = {V1 / "worker" / "model_runner.py", V1 / "worker" / "worker.py"}
"""The runner's module, and the Worker that builds it and calls its public methods."""


def sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def runner_uses(source: str) -> list[str]:
    """`line: code` of every reference to a runner in `source`: a name, argument or attribute
    called runner / model_runner / ModelRunner, or an import of v1.worker.model_runner."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = (
            (isinstance(node, ast.Name) and node.id in RUNNER_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in RUNNER_NAMES)
            or (isinstance(node, ast.arg) and node.arg in RUNNER_NAMES)
            or (isinstance(node, ast.ImportFrom) and node.module == "v1.worker.model_runner")
            or (
                isinstance(node, ast.ImportFrom)
                and node.module == "v1.worker"
                and any(a.name == "model_runner" for a in node.names)
            )
        )
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_runner_reads() -> None:
    """The scan itself, on what the model states looked like with their back-pointer."""
    source = (
        "from v1.worker.model_runner import StepInputs\n"
        "class S:\n"
        "    def f(self, runner):\n"
        "        return self.runner.model, runner.device\n"
    )
    assert sorted(runner_uses(source)) == [
        "1: from v1.worker.model_runner import StepInputs",
        "3: runner",
        "4: runner",
        "4: self.runner",
    ]


def test_no_code_outside_the_runner_reads_runner_attributes() -> None:
    checked = [p for p in sources(V1) if p not in OWNERS]
    assert V1 / "worker" / "cuda_graphs.py" in checked
    assert V1 / "worker" / "model_states" / "whisper.py" in checked
    uses = [
        f"{path.relative_to(V1.parent)}:{use}"
        for path in checked
        for use in runner_uses(path.read_text())
    ]
    assert uses == [], "\n".join(uses)


def test_model_states_leave_graph_or_eager_to_the_runner() -> None:
    """No state names the CUDA graphs: the runner asks `can_run` and replays, or calls the
    state's eager forward."""
    words = {"cuda_graphs", "CudaGraphManager", "can_run"}
    uses = []
    for path in sources(V1 / "worker" / "model_states"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "id", None) or getattr(node, "attr", None)
            module = getattr(node, "module", None) or ""
            if name in words or module.endswith("cuda_graphs"):
                uses.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert uses == [], "\n".join(uses)


def test_states_and_graphs_are_built_from_their_parts() -> None:
    fields = {f.name for f in dataclasses.fields(StateContext)}
    assert {"model", "input_batch", "attn_metadata", "device", "config"} <= fields
    assert not fields & RUNNER_NAMES
    assert list(inspect.signature(ModelState.__init__).parameters) == ["self", "ctx"]
    graph_params = set(inspect.signature(CudaGraphManager.__init__).parameters)
    assert {"attn_metadata", "input_batch", "decode_forward"} <= graph_params
    assert not graph_params & RUNNER_NAMES
