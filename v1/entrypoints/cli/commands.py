"""The `v1` parser and dispatch: the entry points' subcommands (`serve`, `transcribe`,
`generate`, `embed`) and those that packages above add as `Subcommand`s (`v1 batch`)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from v1.entrypoints.cli.engine_args import add_engine_args, engine_kwargs
from v1.entrypoints.cli.report import error
from v1.entrypoints.cli.serve import add_serve_parser, run_serve
from v1.entrypoints.cli.text import (
    add_embed_parser,
    add_generate_parser,
    run_embed,
    run_generate,
)
from v1.entrypoints.cli.transcribe import add_transcribe_parser, run_transcribe


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """A subcommand that a package above the entry points adds to `v1` (`v1 batch`)."""

    add_parser: Callable[[Any, Callable[..., None]], None]
    """`add_parser(subparsers, add_engine_args)` declares the subcommand's parser."""
    run: Callable[[argparse.Namespace, dict[str, Any]], int]
    """`run(args, engine_kwargs(args))` runs it and returns the exit code."""


def make_parser(extra: Mapping[str, Subcommand] | None = None) -> argparse.ArgumentParser:
    """The `v1` parser: the entry points' subcommands, then the `extra` ones."""
    from v1.version import __version__

    parser = argparse.ArgumentParser(
        prog="v1", description="v1-engine: serve and run transformer models."
    )
    parser.add_argument("--version", action="version", version=f"v1-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_serve_parser(sub)
    add_transcribe_parser(sub)
    add_generate_parser(sub)
    add_embed_parser(sub)
    for command in (extra or {}).values():
        command.add_parser(sub, add_engine_args)
    return parser


_COMMANDS = {
    "serve": run_serve,
    "transcribe": run_transcribe,
    "generate": run_generate,
    "embed": run_embed,
}


def main(argv: Sequence[str] | None = None, extra: Mapping[str, Subcommand] | None = None) -> int:
    """Parses `argv` and runs the subcommand; `extra`: subcommands added from above."""
    extra = extra or {}
    parser = make_parser(extra)
    args = parser.parse_args(argv)
    if args.command != "serve":  # the server handles its own signals
        # SIGTERM unwinds like Ctrl-C, so the engine shuts down and its socket dir goes.
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        if args.command in extra:
            return extra[args.command].run(args, engine_kwargs(args))
        return _COMMANDS[args.command](args)
    except ValueError as e:  # bad model, engine argument or input: the user's to fix
        error(args.command, str(e))
        return 2
    except KeyboardInterrupt:
        return 130


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
