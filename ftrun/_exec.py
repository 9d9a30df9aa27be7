"""Worker shim: tie the worker's life to its launcher, then become the real command.

``python -m ftrun._exec CMD ARGS...`` sets PR_SET_PDEATHSIG so the kernel kills the worker
when the launcher dies (even by SIGKILL), then ``execvp``s CMD. The death signal survives
exec, so the training script runs exactly as torchrun would run it, minus the orphan problem:
torch starts workers in their own session, so without this a killed launcher leaves them
blocked in a collective until the process-group timeout.
"""

from __future__ import annotations

import os
import signal
import sys

from ftrun.pdeath import LAUNCHER_PID_ENV, set_parent_death_signal


def main(argv: list[str]) -> None:
    if not argv:
        sys.stderr.write("usage: python -m ftrun._exec CMD [ARGS...]\n")
        raise SystemExit(2)
    set_parent_death_signal(signal.SIGKILL)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected and os.getppid() != int(expected):
        # The launcher died between fork and prctl: the signal will never come.
        raise SystemExit(f"ftrun worker: launcher {expected} is gone; not starting {argv[0]}")
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        raise SystemExit(f"ftrun worker: cannot run {argv[0]!r}: {e.strerror}") from e


if __name__ == "__main__":
    main(sys.argv[1:])
