"""Run ``examples/train.py`` unchanged, with a wall-clock timestamp for every completed step.

``bench/restart.py`` launches this file instead of ``examples/train.py`` (same flags) under
ftrun and under torchrun. It appends JSON lines to the file named by ``$FTRUN_BENCH_STEPLOG``:

- ``{"ev": "start", ...}`` once, as soon as the interpreter runs this file;
- ``{"ev": "run", ...}`` each time the job's function (``run``, under ``@ftrun.resilient``)
  is called: once per process, and again in the same process after an in-place restart;
- ``{"ev": "step", "step": S, ...}`` whenever the script reports step ``S`` as completed;
- ``{"ev": "done", "step": S, ...}`` when it reports that training is over
  (``progress(S, done=True)``).

Each line also has ``t`` (``time.time()``, the clock of the fault marker's ``"time"``),
``rank``, ``restart`` (``$TORCHELASTIC_RESTART_COUNT``) and ``pid``; the start line also has
``ftrun``, the directory the ``ftrun`` package was imported from. Lines are written with one
``write`` to an ``O_APPEND`` descriptor, so the ranks' lines never interleave.

``train.py`` binds its step hook at import time (``_progress = ftrun.progress``, or a no-op when
``ftrun`` cannot be imported). The script is therefore imported as a module, its module-level
``_progress`` wrapped (the wrapper calls the original first, so ftrun's hang detection sees the
same reports), and then its ``main()`` called. That works under both launchers, with or
without ftrun installed.
"""

from __future__ import annotations

import json
import os
import sys
import time

_START = time.time()

import importlib.util  # noqa: E402  (timestamp first: it marks the process start)
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

STEPLOG_ENV = "FTRUN_BENCH_STEPLOG"
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"

_fd: int | None = None


def _record(ev: str, t: float, **data: object) -> None:
    """Append one JSON line to the step log (no-op when the variable is unset)."""
    global _fd
    path = os.environ.get(STEPLOG_ENV)
    if not path:
        return
    if _fd is None:
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rec = {
        "ev": ev,
        "t": t,
        "rank": int(os.environ.get("RANK", "0")),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        "pid": os.getpid(),
        **data,
    }
    os.write(_fd, (json.dumps(rec) + "\n").encode())


def _timed(hook: Callable[..., None]) -> Callable[..., None]:
    def progress(step: int, *args: Any, **kwargs: Any) -> None:
        hook(step, *args, **kwargs)
        done = bool(kwargs.get("done", args[0] if args else False))
        _record("done" if done else "step", time.time(), step=int(step))

    return progress


def _ftrun_dir() -> str | None:
    try:
        import ftrun
    except Exception:
        return None
    return os.path.dirname(os.path.abspath(ftrun.__file__))


def main() -> int:
    _record("start", _START, ftrun=_ftrun_dir())
    spec = importlib.util.spec_from_file_location("ftrun_bench_train", TRAIN)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {TRAIN}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module._progress = _timed(module._progress)
    # Record each run of the job's function, the in-place reruns included: wrap the function
    # the decorator wraps and decorate the wrapper again (train.py's own ``_resilient``).
    inner = getattr(module.run, "__wrapped__", module.run)

    def timed_run(*args: Any, **kwargs: Any) -> Any:
        _record("run", time.time())
        return inner(*args, **kwargs)

    module.run = module._resilient(timed_run)
    sys.argv[0] = str(TRAIN)
    return int(module.main())


if __name__ == "__main__":
    sys.exit(main())
