"""Real processes for tests and benchmarks: started in sessions of their own, always reaped.

Ports come from the OS (:func:`free_port`), waits are conditions with a deadline
(:func:`wait_for`), and clean-up signals only what the caller started: the process groups of
its own children (each a session leader by construction) and the processes carrying a token
it put in their environment (torch starts workers in sessions of their own, so a token is how
their leftovers are found). Nothing is ever looked up or killed by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

# The checkout this ftrun was imported from (the editable install of scripts/setup.sh).
REPO = Path(__file__).resolve().parent.parent.parent
TRAIN = str(REPO / "examples" / "train.py")
KILL_TIMEOUT_S = 30.0
# Launchers put NAME=<private value> in the environment of every process of a job.
TOKEN_ENV = "FTRUN_BENCH_JOB_TOKEN"
_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


# -- ports and waits ----------------------------------------------------------------------------


def free_port() -> int:
    """A port the OS just handed out (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], T], timeout_s: float, what: str,
             interval_s: float = 0.1) -> T:
    """Poll ``cond`` until it returns something truthy and return that; AssertionError naming
    ``what`` after ``timeout_s`` (``cond`` is always tried once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


# -- processes in /proc -------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (state first); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie is dead for our purposes)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != b"Z"


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def tree_pids(root: int) -> list[int]:
    """``root`` and every process descended from it, now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = parent_pid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pids_with_token(token: bytes) -> list[int]:
    """Processes of this user whose environment contains ``token`` (``NAME=value``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_sessions(procs: Iterable[subprocess.Popen[Any]], token: bytes | None = None,
                  timeout_s: float = KILL_TIMEOUT_S) -> int:
    """SIGKILL the process groups of ``procs`` (children started with
    ``start_new_session=True``) that still run and reap them; then, with ``token``, every
    process still carrying it (its whole group when it leads one), until none is left or
    ``timeout_s`` passed. Returns how many token carriers were found alive (0 after a
    clean exit)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # our child: a session leader by construction
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=timeout_s)
    if token is None:
        return 0
    found = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [pid for pid in pids_with_token(token) if pid_alive(pid)]
        if not pids:
            break
        found = max(found, len(pids))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    return found


def request_launcher_stacks(*roots: int, settle_s: float = 1.0) -> bool:
    """Make the ``ftrun`` launchers in the process trees of ``roots`` write their threads'
    stacks to their output (they arm ftrun.rank.progress.STACKS_SIGNAL), then give them
    ``settle_s`` to; True if the first root's was asked."""
    from ftrun.rank.progress import STACKS_SIGNAL

    launchers = [pid for root in roots for pid in tree_pids(root)
                 if cmdline(pid)[1:3] == ["-m", "ftrun"]]
    first = bool(roots) and any(pid in launchers for pid in tree_pids(roots[0]))
    for pid in launchers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, STACKS_SIGNAL)
    if launchers:
        time.sleep(settle_s)
    return first


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class Procs:
    """``ftrun`` processes a test started, with their output in log files; all are killed
    and reaped by :meth:`cleanup` (the ``procs`` fixture calls it, even on failure)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[str]] = []

    def ftrun(self, *args: str, env: dict[str, str] | None = None,
              name: str = "ftrun") -> subprocess.Popen[str]:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        out = open(self.tmp_path / f"{name}.{len(self.procs)}.log", "w+")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftrun", *args], stdout=out, stderr=subprocess.STDOUT,
            text=True, env=full_env, cwd=REPO, start_new_session=True,
        )
        proc.log_path = out.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def output(proc: subprocess.Popen[str]) -> str:
        return Path(proc.log_path).read_text()  # type: ignore[attr-defined]

    def started(self) -> list[subprocess.Popen[str]]:
        """Every process started here (what :meth:`wait` looks at besides the one awaited)."""
        return list(self.procs)

    def wait(self, proc: subprocess.Popen[str], timeout_s: float) -> int:
        """``proc``'s exit code; AssertionError after ``timeout_s`` with its output, ending
        in its launcher's threads' stacks, and the ends of the other running launchers'
        outputs (with their stacks too)."""
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            running = [p for p in self.started() if p is not proc and p.poll() is None]
            dumped = request_launcher_stacks(proc.pid, *(p.pid for p in running))
            others = "".join(f"\n--- another running launcher (pid {p.pid}) ---\n"
                             f"{self.output(p)[-6000:]}" for p in running)
            raise AssertionError(
                f"ftrun did not finish in {timeout_s} s; output"
                f"{' (ending in its stacks)' if dumped else ''}:\n"
                f"{self.output(proc)[-12000 if dumped else -4000:]}{others}"
            ) from None

    def cleanup(self) -> None:
        kill_sessions(self.procs)
        if self.procs:
            # Launchers killed here take their stores with them (parent-death signal); the
            # segments they leave are removed the way a later store would remove them.
            from ftrun.snapshot.segment import clean_leftovers

            deadline = time.monotonic() + 10
            while clean_leftovers() and time.monotonic() < deadline:
                time.sleep(0.1)


class Launchers:
    """The launcher processes of one job invocation, one per node, always reaped.

    Each starts in a session of its own, with a parent-death signal (it dies with the
    benchmark even when that is SIGKILLed) and a private token in its environment, which
    every process of the job inherits; :meth:`kill` uses both (:func:`kill_sessions`).
    """

    def __init__(self, cmd: Sequence[str], nodes: int, env: dict[str, str], log_dir: Path,
                 tag: str, cwd: Path) -> None:
        self.token = f"{TOKEN_ENV}={tag}-{os.getpid()}-{time.monotonic_ns()}"
        name, _, value = self.token.partition("=")
        self.logs = [log_dir / f"{tag}-node{i}.log" for i in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = time.time()
        full_env = {**env, name: value}
        for log in self.logs:
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(
                    list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=full_env, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent,
                ))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def running(self) -> bool:
        return any(c is None for c in self.codes())

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def wait(self, timeout_s: float) -> list[int | None]:
        """Wait up to ``timeout_s`` for every launcher; returns their exit codes (None: alive)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        return self.codes()

    def kill(self) -> int:
        """SIGKILL whatever of this job is left; returns how many token carriers were found
        alive once the launchers were gone (0 after a clean exit)."""
        return kill_sessions(self.procs, self.token.encode())

    def tail(self, chars: int = 3000) -> str:
        parts = []
        for log in self.logs:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-chars:])
        return "\n".join(parts)


# -- what jobs write ----------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line being written is skipped); [] if missing."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def read_events(state_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The job's structured event log (``STATE/jobs/RUN_ID/events.jsonl``); [] if none yet."""
    return read_jsonl(Path(state_dir) / "jobs" / run_id / "events.jsonl")


def result_line(output: str) -> str:
    """The one ``ftrun-example: step=... params_xxh3=...`` line examples/train.py prints."""
    lines = [ln for ln in output.splitlines() if ln.startswith("ftrun-example: step=")]
    if len(lines) != 1:
        raise AssertionError(f"expected one result line, got {lines}\n{output[-4000:]}")
    return lines[0]


# -- the code under test ------------------------------------------------------------------------


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool = False, path: str | Path | None = None) -> Iterator[Path]:
    """A fresh directory: ``path`` (created; must not exist, and kept), else a temporary one,
    removed at the end unless ``keep`` (then its path is printed on stderr)."""
    if path:
        made = Path(path).resolve()
        made.mkdir(parents=True)
        yield made
        return
    made = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield made
    finally:
        if keep:
            print(f"work directory kept: {made}", file=sys.stderr)
        else:
            shutil.rmtree(made, ignore_errors=True)


def freeze_code(dest: Path, paths: Sequence[str], commit: str | None = None) -> str:
    """Copy ``paths`` (relative to the repository) to ``dest``; returns a short digest.

    Jobs then import the copy (``PYTHONPATH``, working directory), so a long run measures one
    version of the code even while the tree is being edited. The copy is of the working tree,
    or of ``commit`` (``git archive``) when given.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if commit:
        archive = subprocess.run(["git", "archive", "--format=tar", commit, *paths], cwd=REPO,
                                 capture_output=True, timeout=120)
        if archive.returncode:
            raise ValueError(f"git archive {commit}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True,
                       timeout=120)
    for rel in [] if commit else paths:
        src, dst = REPO / rel, dest / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    digest = hashlib.sha256()
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def git_tree(commit: str | None = None) -> str:
    """The commit measured, and whether the working tree had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", commit or "HEAD"], cwd=REPO,
                              text=True, capture_output=True, timeout=30,
                              check=True).stdout.strip()
        if commit:
            return head
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, text=True, capture_output=True, timeout=30,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")
