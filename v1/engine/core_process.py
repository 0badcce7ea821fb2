"""The EngineCore program: `python -m v1.engine.core_process --config FILE --input ADDR --output
ADDR` starts a core for a frontend that bound both addresses (our clients, or one written in
another language; docs/protocol.md). It picks the executor the core runs, so the core itself never
names an implementation: `--executor-factory module:Name` (tests), else the config's backend.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from typing import Any

from v1.config import EngineConfig
from v1.core.engine_core_proc import CoreOptions, run_engine_core
from v1.core.executor import ExecutorFactory
from v1.executor import executor_class

_FACTORY_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_executor_factory(path: str) -> ExecutorFactory:
    """`package.module:Name` -> the importable callable it names (tests inject fake executors
    this way; nothing but an import path crosses the process boundary)."""
    if not _FACTORY_PATH.match(path):
        raise ValueError(f"executor factory must look like 'package.module:Name', got {path!r}")
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"executor factory {path!r} is not callable")
    return obj


def executor_chooser(factory_path: str | None) -> Callable[[EngineConfig], ExecutorFactory]:
    """The executor a core runs: the one `factory_path` names, else the config's backend."""
    if factory_path is None:
        return executor_class
    return lambda config: load_executor_factory(factory_path)


def main(argv: list[str] | None = None) -> None:
    """`python -m v1.engine.core_process --config FILE --input ADDR --output ADDR`: start a
    core for a frontend that bound both addresses (our clients, or one written in another
    language). `--config -` reads the config's JSON from the first line of stdin."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig JSON file (to_json), or -")
    parser.add_argument("--input", required=True, help="address the frontend PUSHes to")
    parser.add_argument("--output", required=True, help="address the frontend PULLs from")
    parser.add_argument(
        "--frontend",
        nargs=2,
        action="append",
        default=[],
        metavar=("INPUT", "OUTPUT"),
        help="the addresses of one more frontend sharing the core (client_index 1, 2, ...)",
    )
    parser.add_argument("--executor-factory", default=None, help="package.module:Name (tests)")
    parser.add_argument("--parent-pid", type=int, default=None, help="the frontend's pid")
    parser.add_argument(
        "--watch-stdin",
        action="store_true",
        help="stdin is a pipe from the frontend: exit when it closes",
    )
    parser.add_argument(
        "--ipc-dir", default=None, help="socket directory to remove if the frontend dies first"
    )
    args = parser.parse_args(argv)
    if args.config == "-":
        config_json = sys.stdin.buffer.readline().decode()
    else:
        with open(args.config) as f:
            config_json = f.read()
    options = CoreOptions(args.parent_pid, args.watch_stdin, args.ipc_dir)
    chooser = executor_chooser(args.executor_factory)
    extra = tuple((i, o) for i, o in args.frontend)
    run_engine_core(config_json, args.input, args.output, chooser, options, extra)


if __name__ == "__main__":
    main()
