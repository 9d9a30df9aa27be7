"""Parent-death signals, so no process ftrun starts outlives its launcher."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from ftrun import knobs

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = knobs.LAUNCHER_PID.name
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits.

    Linux only; elsewhere it logs once and returns False (the launcher still reaps workers
    on every orderly exit).
    """
    if not sys.platform.startswith("linux"):
        log.debug("parent-death signal unsupported on %s", sys.platform)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(err))
        return False
    return True


def _call_tied_to_launcher(fn: Callable[..., Any], *args: Any) -> Any:
    set_parent_death_signal(signal.SIGKILL)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected and os.getppid() != int(expected):
        raise SystemExit(f"ftrun worker: launcher {expected} is gone")
    return fn(*args)


def tie_entrypoint(entrypoint: Any, args: tuple) -> tuple[Any, tuple]:
    """Wrap a torchrun entrypoint so the worker dies with its launcher.

    A command (str) runs through ``python -m ftrun._exec``; a function (``--run-path``) is
    wrapped in a picklable partial that sets the signal in the spawned child first.
    """
    if isinstance(entrypoint, str):
        return sys.executable, ("-m", "ftrun._exec", entrypoint, *args)
    return functools.partial(_call_tied_to_launcher, entrypoint), args
