"""The `v1` logger.

`init_logger(name)` configures the package's root logger once (level: `envs.V1_LOG_LEVEL`).
"""

from __future__ import annotations

import logging

from v1 import envs

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("v1")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
        root.setLevel(envs.V1_LOG_LEVEL)
        _configured = True
    return logging.getLogger(name)
