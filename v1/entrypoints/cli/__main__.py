"""`python -m v1.entrypoints.cli`: the entry points' subcommands (no `v1 batch`)."""

import sys

from v1.entrypoints.cli.commands import main

sys.exit(main())
