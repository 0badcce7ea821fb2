"""What the `v1` command prints when it cannot go on: one line on stderr."""

from __future__ import annotations

import sys


def error(command: str, message: str) -> None:
    print(f"v1 {command}: error: {message}", file=sys.stderr, flush=True)
