"""The `v1` command (console script, or `python -m v1`): the entry points' subcommands plus
`v1 batch`. v1.batch sits above v1.entrypoints, so the command offering both sits above both."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from v1.batch.cli import add_batch_parser, run_batch_command
from v1.entrypoints import cli

COMMANDS = {"batch": cli.Subcommand(add_batch_parser, run_batch_command)}


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
