"""Logging set-up for ftrun's own processes (launcher, coordinator, CLI).

Library code only calls ``logging.getLogger(__name__)``; the CLI configures the ``ftrun``
logger once. The root logger is left alone.
"""

from __future__ import annotations

import logging
import sys

from ftrun import knobs

_FORMAT = "[ftrun %(asctime)s %(levelname)s %(name)s] %(message)s"


def configure(level: str | int | None = None, prefix: str = "") -> None:
    logger = logging.getLogger("ftrun")
    if getattr(configure, "_done", False):
        if level is not None:
            logger.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    fmt = _FORMAT if not prefix else _FORMAT.replace("%(message)s", f"{prefix} %(message)s")
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level or knobs.LOG_LEVEL.get().upper())
    logger.propagate = False
    configure._done = True  # type: ignore[attr-defined]
