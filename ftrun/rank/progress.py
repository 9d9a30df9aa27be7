"""Progress reports from a rank to its launcher, for hang detection.

Each rank gets a tiny file (``FTRUN_PROGRESS_FILE``) that it maps and overwrites with
``(step, CLOCK_MONOTONIC ns)`` whenever it calls :func:`progress`. The launcher reads the same
file (``read_progress``) and restarts the workers when a rank that reported before goes
silent for longer than ``--hang-timeout``. CLOCK_MONOTONIC is one clock for the whole host, so
launcher and rank compare the same timeline. Writing is a 24-byte store into shared pages: no
system call on the training path.

The first call also arms :data:`STACKS_SIGNAL` (``faulthandler``) and says so in the flags
(``STACKS``): a launcher that finds the rank stuck sends it that signal, and the rank writes
the Python stack of every thread to its stack file (the progress file's path plus
``.stacks``), which the launcher then logs as one block: where the rank hangs. (``faulthandler``
writes from the signal handler, without the GIL: a thread stuck in C code holding the GIL
does not stop it; to a file of its own, since ranks that stall together would otherwise
interleave their dumps on the stderr they share.)
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from ftrun import knobs

_LAYOUT = struct.Struct("<qqq")  # step, monotonic ns, flags
# Then, written by the collective monitor's thread (ftrun.rank.collectives): since when (the
# rank's monotonic ns) its oldest pending collective waits; 0 while none is pending. The
# launcher tells a rank blocked in a collective (waiting for a peer: a victim) from one that
# stopped outside any (the culprit).
_WAIT = struct.Struct("<q")
DONE = 1
STACKS = 2  # STACKS_SIGNAL makes this rank write its threads' stacks to its stack file
SIZE = _LAYOUT.size
FILE_SIZE = SIZE + _WAIT.size
# A real-time signal (no default handler a user relies on), not the in-process restart's.
STACKS_SIGNAL = signal.SIGRTMIN + 5

_stacks = 0
_stacks_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor

_map: mmap.mmap | None = None
_path: str | None = None
_map_lock = threading.Lock()


def create_progress_file(path: str) -> None:
    """Create (or reset) a rank's progress file; called by the launcher before each start."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, _LAYOUT.pack(-1, 0, 0) + _WAIT.pack(0))
    finally:
        os.close(fd)


def progress(step: int, *, done: bool = False) -> None:
    """Tell the launcher this rank finished ``step``. A no-op outside ftrun; never raises.

    ``done=True`` says training is over: the launcher stops watching this rank for hangs
    while it writes results and exits.
    """
    try:
        m = _mapping()
        if m is not None:
            m[:SIZE] = _LAYOUT.pack(int(step), time.monotonic_ns(),
                                    (DONE if done else 0) | _stacks)
            if not _imports_noted:
                note_imports()
    except (OSError, ValueError):
        # The launcher owns the file; if it vanished, the launcher is gone or restarting us.
        _forget()


# The torch modules imported by the first finished step, noted once per process in the job's
# directory on this host for the node's warm interpreters (ftrun.launcher.warm_boot), which
# import them while they wait: much of torch is imported lazily by a rank's first steps
# (DDP's constructor imports torch._dynamo), and a replacement rank would pay for it while
# the survivors wait in their first collective with it. The first rank to write wins.
LEARNED_IMPORTS = "warm-imports.txt"  # in FTRUN_JOB_DIR; ftrun.launcher.warm passes it on
_imports_noted = False


def note_imports() -> None:
    """Write the names of the ``torch`` modules this process imported to
    ``FTRUN_JOB_DIR/warm-imports.txt``, unless a rank did already; once per process, never
    raises."""
    global _imports_noted
    _imports_noted = True
    job_dir = knobs.JOB_DIR.get()
    if not job_dir:
        return
    path = os.path.join(job_dir, LEARNED_IMPORTS)
    try:
        if os.path.exists(path):
            return
        names = sorted(n for n in list(sys.modules) if n == "torch" or n.startswith("torch."))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(f"{n}\n" for n in names))
        os.replace(tmp, path)
    except OSError:
        pass  # warm interpreters then import torch alone, as before


def collective_wait(since_ns: int) -> None:
    """Collective monitor: this rank's oldest pending collective waits since ``since_ns``
    (monotonic; 0: none pending). A no-op outside ftrun; never raises."""
    try:
        m = _mapping()
        if m is not None and len(m) >= FILE_SIZE:
            m[SIZE:FILE_SIZE] = _WAIT.pack(int(since_ns))
    except (OSError, ValueError):
        _forget()


def _mapping() -> mmap.mmap | None:
    """The progress file, mapped (again when FTRUN_PROGRESS_FILE changed); None outside
    ftrun. Called from the training thread and the collective monitor's."""
    global _map, _path, _stacks
    path = knobs.PROGRESS_FILE.get()
    if not path:
        return None
    with _map_lock:
        if _map is None or _path != path:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                _map = mmap.mmap(fd, FILE_SIZE if size >= FILE_SIZE else SIZE)
            finally:
                os.close(fd)
            _path = path
            _stacks = _arm_stacks(path)
        return _map


def _forget() -> None:
    global _map
    with _map_lock:
        _map = None


@dataclass(frozen=True)
class Progress:
    step: int
    monotonic_ns: int
    flags: int = 0
    coll_since_ns: int = 0  # since when its oldest pending collective waits (0: none)

    @property
    def reported(self) -> bool:
        return self.step >= 0

    @property
    def done(self) -> bool:
        return bool(self.flags & DONE)

    @property
    def current_step(self) -> int | None:
        """The step the rank is in: the one after the last it finished (that one, once it
        said training is over); None before its first report."""
        if not self.reported:
            return None
        return self.step if self.done else self.step + 1

    def age_s(self, now_ns: int | None = None) -> float:
        return ((now_ns or time.monotonic_ns()) - self.monotonic_ns) / 1e9

    def collective_wait_s(self, now_ns: int | None = None) -> float | None:
        """How long the rank has waited in a collective (None: it waits in none, or its
        collective monitor does not run)."""
        if self.coll_since_ns <= 0:
            return None
        return max(0.0, ((now_ns or time.monotonic_ns()) - self.coll_since_ns) / 1e9)


def stacks_path(progress_path: str) -> str:
    return progress_path + ".stacks"


def _arm_stacks(progress_path: str) -> int:
    """Register the stack dump on :data:`STACKS_SIGNAL`, into the rank's stack file;
    ``STACKS``, or 0 where it cannot be."""
    global _stacks_file
    try:
        f = open(stacks_path(progress_path), "a", encoding="utf-8")  # noqa: SIM115 - kept
    except OSError:
        return 0
    try:
        faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        f.close()
        return 0
    if _stacks_file is not None:
        _stacks_file.close()
    _stacks_file = f
    return STACKS


def request_stacks(pid: int, progress_path: str, progress: Progress | None) -> int | None:
    """Launcher: make rank ``pid`` write its threads' Python stacks to its stack file, when
    its progress file says it armed the signal. Returns where in that file the dump begins
    (for :func:`read_stacks`), or None when the rank was not asked."""
    if progress is None or not progress.flags & STACKS:
        return None
    try:
        offset = os.path.getsize(stacks_path(progress_path))
        os.kill(pid, STACKS_SIGNAL)
    except OSError:
        return None
    return offset


def read_stacks(progress_path: str, offset: int, limit: int = 1 << 16) -> str:
    """What the rank wrote to its stack file from ``offset`` (at most ``limit`` bytes)."""
    try:
        with open(stacks_path(progress_path), "rb") as f:
            f.seek(offset)
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def last_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The last step each rank with a progress file (``progress-<local rank>``) in
    ``directory`` finished, for those that reported one."""
    steps = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("progress-") and name.removeprefix("progress-").isdigit():
            p = read_progress(os.path.join(directory, name))
            if p is not None and p.reported:
                steps.append(p.step)
    return steps


def read_progress(path: str) -> Progress | None:
    try:
        with open(path, "rb") as f:
            data = f.read(FILE_SIZE)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    since = _WAIT.unpack(data[SIZE:FILE_SIZE])[0] if len(data) >= FILE_SIZE else 0
    return Progress(*_LAYOUT.unpack(data[:SIZE]), coll_since_ns=since)
