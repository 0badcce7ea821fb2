"""The `v1` command's parser and its entry-point subcommands (`serve`, `transcribe`,
`generate`, `embed`); packages above add theirs as `Subcommand`s (`v1 batch`, through
`v1.__main__`). Engine flags and their help come from `v1.config.engine_arg_fields()`. Inputs and
the model are checked before the model loads; errors are one line on stderr.

`engine_args.py` (the engine flags), one module per subcommand (`serve.py`, `transcribe.py`,
`text.py` for generate and embed), `commands.py` (the parser and dispatch), `report.py` (the
error line).
"""

from v1.entrypoints.cli.commands import Subcommand, main, make_parser
from v1.entrypoints.cli.engine_args import (
    IGNORED_ENGINE_ARGS,
    add_engine_args,
    attribute_docs,
    engine_kwargs,
)
from v1.entrypoints.cli.text import check_model_kind

__all__ = [
    "IGNORED_ENGINE_ARGS",
    "Subcommand",
    "add_engine_args",
    "attribute_docs",
    "check_model_kind",
    "engine_kwargs",
    "main",
    "make_parser",
]
