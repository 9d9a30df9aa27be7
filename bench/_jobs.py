"""Helpers for benchmarks that drive real ``ftrun`` jobs of several launchers on localhost.

A job's launchers are started in sessions of their own, with a parent-death signal (so they
die with the benchmark even when it is SIGKILLed) and a private token in their environment,
which every process of the job inherits (torch starts workers in sessions of their own, so
the token is how their leftovers are found). :meth:`Launchers.kill` SIGKILLs the launchers'
process groups and every process still carrying the token; nothing else is ever signalled.
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "FTRUN_BENCH_JOB_TOKEN"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port the OS just handed out (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


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


def freeze_code(dest: Path, paths: Sequence[str], commit: str | None = None) -> str:
    """Copy ``paths`` (relative to the repository) to ``dest``; returns a short digest.

    Jobs then import the copy (``PYTHONPATH``, working directory), so a long run measures one
    version of the code even while the tree is being edited. The copy is of the working tree,
    or of ``commit`` (``git archive``) when given.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if commit:
        archive = subprocess.run(["git", "archive", "--format=tar", commit, *paths], cwd=ROOT,
                                 capture_output=True, timeout=120)
        if archive.returncode:
            raise ValueError(f"git archive {commit}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True,
                       timeout=120)
    for rel in [] if commit else paths:
        src, dst = ROOT / rel, dest / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    digest = hashlib.sha256()
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(dest)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def git_tree(commit: str | None = None) -> str:
    """The commit measured, and whether the working tree had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", commit or "HEAD"], cwd=ROOT,
                              text=True, capture_output=True, timeout=30,
                              check=True).stdout.strip()
        if commit:
            return head
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=30,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this launcher when the benchmark's thread that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def pids_with_token(token: bytes) -> list[int]:
    """Processes of this user whose environment contains ``token``."""
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


class Launchers:
    """The launcher processes of one job invocation, one per node, always reaped."""

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
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)  # a session leader by construction
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        token = self.token.encode()
        found = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = [pid for pid in pids_with_token(token) if pid_alive(pid)]
            if not pids:
                break
            found = max(found, len(pids))
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        return found

    def tail(self, chars: int = 3000) -> str:
        parts = []
        for log in self.logs:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-chars:])
        return "\n".join(parts)
