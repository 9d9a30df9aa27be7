"""The harness that ftrun's tests and benchmarks share: processes, ports, waits, namespaces.

One copy of each helper, imported by ``tests/`` (through ``tests/conftest.py`` and
``tests/netns.py``, which add the pytest fixtures) and by ``bench/`` (plain imports):

- :mod:`ftrun.testing.procs`: :func:`free_port`, :func:`wait_for` (a condition with a
  deadline), process look-ups in ``/proc``, :func:`kill_sessions` (process groups by PID and
  the processes that carry a job's token), :class:`Procs` and :class:`Launchers` (real
  processes that are always reaped), event and step logs, :func:`work_dir`,
  :func:`freeze_code` (copy the code under test), :func:`git_tree`;
- :mod:`ftrun.testing.netns`: :class:`~ftrun.testing.netns.Cluster`, network namespaces as
  hosts on one bridge (address, host name, loopback, shared memory of their own; link down,
  tc tbf).

Why here, inside the package (as ``torch.testing``), rather than a top-level ``harness/``:
``bash scripts/setup.sh`` installs ftrun (editable) into the venv, so ``import ftrun.testing``
works from pytest (run from the repository root, ``testpaths = ["tests"]``), from
``.venv/bin/python bench/x.py`` (whose ``sys.path[0]`` is ``bench/``) and from any helper
process they start, with no ``sys.path`` insertion anywhere. A top-level ``harness/`` is not
installed and would need the repository root put on ``sys.path`` by every bench script and
by pytest's configuration. The cost is small: nothing in ftrun imports this package, it
needs only the standard library (and pytest nowhere), and helpers that need the source tree
(:data:`~ftrun.testing.procs.REPO`, :func:`freeze_code`, :func:`git_tree`) are meant for a
checkout, which the editable install is.
"""

from ftrun.testing.procs import (
    REPO,
    TOKEN_ENV,
    TRAIN,
    Launchers,
    Procs,
    cmdline,
    free_port,
    freeze_code,
    git_tree,
    kill_sessions,
    parent_pid,
    pid_alive,
    pids_with_token,
    read_events,
    read_jsonl,
    result_line,
    tree_pids,
    wait_for,
    work_dir,
)

__all__ = [
    "REPO",
    "TOKEN_ENV",
    "TRAIN",
    "Launchers",
    "Procs",
    "cmdline",
    "free_port",
    "freeze_code",
    "git_tree",
    "kill_sessions",
    "parent_pid",
    "pid_alive",
    "pids_with_token",
    "read_events",
    "read_jsonl",
    "result_line",
    "tree_pids",
    "wait_for",
    "work_dir",
]
