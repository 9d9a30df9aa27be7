"""Warm workers: interpreters started ahead, with torch imported, that become ranks.

A cold worker spends its first seconds starting Python and importing torch (1.5 s on this
project's 2-core CPU machine; more on GPU nodes, where torch loads its CUDA libraries). A
:class:`WarmPool` keeps as many interpreters as the node has local ranks started ahead (see
:mod:`ftrun.launcher.warm_boot`): each has imported torch and nothing of the job's (no CUDA
context, no process group) and waits for one request. Every worker process torch's agent
starts (the first start, a restart of every worker, a dead rank replaced alone) asks the pool
first (:func:`ftrun._torch.intercept_worker_starts`): an interpreter whose start matches the
request exactly receives the rank's environment, working directory, argv and log files and
runs the script; its pid is the rank's pid, so torch's monitoring, ftrun's kills and control
sockets work as for a cold worker. A replacement is then started in the background. Once a
rank of the job has finished a step, waiting interpreters also import the torch modules it
had imported by then (:data:`~ftrun.rank.progress.LEARNED_IMPORTS`; DDP alone imports
``torch._dynamo``), so that a replacement rank does not make its peers wait for them.

A warm start must be indistinguishable from a cold one. What an interpreter fixes at its start
or while it imports torch must therefore equal the request's, or the worker starts cold (and
the log and the ``worker_cold_start`` event say why):

- the command: ``PYTHON -u SCRIPT ARGS`` or ``PYTHON -u -m MODULE ARGS`` through ftrun's
  worker shim (what torchrun runs), the pool's interpreter and script; the arguments after
  the script are free. ``--no-python``, ``--run-path`` and NUMA-bound commands start cold.
- the environment, on every variable but :data:`PER_START` and ``FTRUN_*``, set per rank and
  per start by torch's agent and ftrun's launcher. Neither Python nor ``import torch`` reads
  any of them (checked by ``tests/test_warm.py``: torch 2.13 reads 70-odd variables at
  import, e.g. ``OMP_NUM_THREADS``, ``TORCH_DISTRIBUTED_DEBUG``, ``MKL_*``; Python reads
  ``PYTHONHASHSEED``, which fixes hash randomization for the interpreter's life, and the other
  ``PYTHON*`` ones at start). A variable that changed since the interpreter started (the
  coordinator's detection endpoint arriving late, a user's wrapper) makes that start cold
  and the pool restarts its interpreters with the new environment.
- the working directory.

The pool owns its interpreters: started from its own thread with the parent-death signal
(they, and ranks they became, die with the launcher, even by SIGKILL), killed and reaped by
:meth:`WarmPool.close`. Interpreters that die before their import finished three times in a
row turn the pool off (logged); workers then start cold as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ftrun import _torch, knobs
from ftrun.launcher import warm_boot
from ftrun.rank.progress import LEARNED_IMPORTS

log = logging.getLogger(__name__)

# Set by torch's agent per worker and start (LocalElasticAgent._start_workers, the error file
# of its process context, the file timer); ftrun's own FTRUN_* variables are per start too.
PER_START = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE",
})
PER_START_PREFIX = "FTRUN_"
# ftrun's worker shim (ftrun.pdeath.tie_entrypoint), whose work the bootstrap does itself.
SHIM = ("-m", "ftrun._exec")
# Interpreters that die before they are ready this many times in a row turn the pool off.
MAX_EARLY_DEATHS = 3
# How long close() waits for an interpreter it killed, and for the pool's thread.
CLOSE_TIMEOUT_S = 5.0
# FTRUN_WARM_WORKERS=auto turns warm workers on from this many usable CPUs per local rank:
# below it, the interpreters' torch imports (started again after every take) compete with
# the ranks' own start and first steps (bench/RESULTS.md, "Warm workers": 3 ranks on 2 CPUs ran 0.5 s longer).
AUTO_CPUS_PER_RANK = 4


def auto_warm(local_ranks: int, cpus: int | None = None) -> bool:
    """FTRUN_WARM_WORKERS=auto (and neither --warm-workers nor --no-warm-workers): on where the
    launcher has AUTO_CPUS_PER_RANK usable CPUs per local rank. Logged either way."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    on = cpus >= AUTO_CPUS_PER_RANK * max(1, local_ranks)
    log.info("warm workers %s: %d usable CPU(s) for %d local rank(s) (on from %d per rank; "
             "--warm-workers or --no-warm-workers decides)", "on" if on else "off", cpus,
             local_ranks, AUTO_CPUS_PER_RANK)
    return on


class EventSink(Protocol):
    def event(self, type: str, **data: Any) -> None: ...


@dataclass(frozen=True)
class WarmCommand:
    """What a warm interpreter runs: ``python -u target`` (mode ``script``) or
    ``python -u -m target`` (mode ``module``)."""

    python: str
    mode: str
    target: str


def parse_command(args: Sequence[str]) -> tuple[WarmCommand, tuple[str, ...]] | str:
    """The warm command of a worker's command line and the script's arguments, or why the
    command cannot start warm."""
    args = [str(a) for a in args]
    if len(args) < 4 or tuple(args[1:3]) != SHIM:
        return "the worker command is not ftrun's worker shim (NUMA binding or --run-path)"
    python, rest = args[3], args[4:]
    if not os.path.basename(python).startswith("python"):
        return f"the worker command {python!r} is not a Python interpreter (--no-python)"
    if rest[:1] != ["-u"]:
        return "the worker command is not torchrun's `python -u ...`"
    rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return WarmCommand(python, "module", rest[1]), tuple(rest[2:])
    if not rest or rest[0].startswith("-"):
        return "the worker command names no script"
    return WarmCommand(python, "script", rest[0]), tuple(rest[1:])


def start_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a worker's environment that a warm interpreter is started with and that a
    request must match: everything but the per-start variables."""
    return {k: v for k, v in env.items()
            if k not in PER_START and not k.startswith(PER_START_PREFIX)}


def env_difference(have: Mapping[str, str], want: Mapping[str, str]) -> str | None:
    """Why a warm interpreter started with ``have`` cannot serve a worker that needs
    ``want`` (both :func:`start_env`); None when they are equal."""
    names = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if not names:
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"the environment differs from the warm interpreters' in {shown}"


def _drain(sock: socket.socket) -> None:
    """Read what the interpreter sent and nobody read (closing a Unix socket with unread
    data resets the connection: the peer would lose the request just sent)."""
    with contextlib.suppress(OSError):
        while sock.recv(64, socket.MSG_DONTWAIT):
            pass


class _Warm:
    """One started interpreter and the launcher's end of its request socket."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket,
                 env: dict[str, str], cwd: str) -> None:
        self.proc = proc
        self.sock = sock
        self.env = env
        self.cwd = cwd
        self.started = time.monotonic()
        self.ready = False
        # The script arguments it runs parked with (FTRUN_PARKED_WORKERS), once sent.
        self.parked: tuple[str, ...] | None = None

    def poll_ready(self) -> bool:
        if not self.ready and self.parked is None:
            try:
                self.ready = self.sock.recv(1, socket.MSG_DONTWAIT) == b"R"
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return False
        return self.ready

    def kill(self) -> None:
        self.sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # it leads its own session
        try:
            self.proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("warm interpreter %d did not exit after SIGKILL", self.proc.pid)


class WarmPool:
    """``size`` warm interpreters for workers running ``command``, refilled in the
    background. :meth:`start` hooks it into torch's worker start; :meth:`close` kills and
    reaps every interpreter not handed out. Interpreters are started from the pool's own
    thread, which lives until :meth:`close`: their parent-death signal fires when the thread
    that started them ends."""

    def __init__(self, command: WarmCommand, env: Mapping[str, str], size: int,
                 imports: Sequence[str] = (), sink: EventSink | None = None,
                 park_args: Sequence[str] | None = None) -> None:
        self.command = command
        # FTRUN_PARKED_WORKERS: the script arguments ready interpreters run the script with,
        # up to its @ftrun.resilient function (None: not parked; see warm_boot).
        self.park_args = None if park_args is None else tuple(park_args)
        self._park_off: str | None = None
        self.size = size
        self.imports = tuple(imports)
        self._sink = sink
        self._env = start_env(env)
        # Where the job's ranks note the torch modules they imported (ftrun.rank.progress):
        # waiting interpreters import them too (warm_boot, LEARNED).
        job_dir = env.get(knobs.JOB_DIR.name) or ""
        self.learned = os.path.join(job_dir, LEARNED_IMPORTS) if job_dir else ""
        self._cwd = os.getcwd()
        self._idle: list[_Warm] = []
        self._cond = threading.Condition()
        self._closed = False
        self._early_deaths = 0
        self._off: str | None = None
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._undo: Callable[[], None] | None = None

    @classmethod
    def for_workers(cls, entrypoint: Any, args: Sequence[Any], env: Mapping[str, str],
                    size: int, imports: Sequence[str] = (),
                    sink: EventSink | None = None) -> WarmPool | None:
        """A pool for the workers of a torchrun spec (entrypoint and arguments after ftrun's
        shim), or None (logged) when they cannot start warm."""
        if not isinstance(entrypoint, str):
            parsed: tuple[WarmCommand, tuple[str, ...]] | str = \
                "the entrypoint is a function (--run-path)"
        else:
            parsed = parse_command([entrypoint, *args])
        if isinstance(parsed, tuple) and parsed[0].mode == "script":
            target = parsed[0].target
            if not os.path.isfile(target) or zipfile.is_zipfile(target):
                parsed = f"{target} is not a Python source file"
        if isinstance(parsed, str):
            log.info("warm workers off: %s; workers start cold", parsed)
            return None
        park = parsed[1] if knobs.PARKED_WORKERS.enabled() else None
        if park is not None:
            log.info("parked workers on: each warm interpreter runs %s up to its "
                     "@ftrun.resilient function and waits there for a rank", parsed[0].target)
        return cls(parsed[0], env, size, imports, sink, park)

    @classmethod
    def start_for(cls, spec: Any, worker_env: Mapping[str, str], imports: Sequence[str],
                  sink: EventSink | None) -> WarmPool | None:
        """Started pool for the workers of torch's ``WorkerSpec`` (one interpreter per local
        rank), or None (logged) where they cannot start warm."""
        pool = cls.for_workers(spec.entrypoint, spec.args, {**os.environ, **worker_env},
                               spec.local_world_size, imports, sink)
        if pool is None:
            return None
        try:
            return pool.start()
        except _torch.SeamMissing as e:
            log.warning("warm workers off: %s", e)
            return None

    # -- the launcher's side ---------------------------------------------------------------

    def start(self) -> WarmPool:
        """Start the pool's thread (which starts the interpreters) and route torch's worker
        starts through :meth:`take`. Raises SeamMissing (another torch)."""
        self._undo = _torch.intercept_worker_starts(self.take)
        self._thread = threading.Thread(target=self._run, name="ftrun-warm-pool", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop refilling, undo the hook, kill and reap every interpreter not handed out.
        Idempotent. Ranks that started warm are the agent's: it has stopped them by now."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        if self._undo is not None:
            self._undo()
            self._undo = None
        for warm in idle:
            warm.kill()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("the warm pool's thread did not stop within %.0f s", CLOSE_TIMEOUT_S)
        with self._cond:  # one the thread started while closing
            idle, self._idle = self._idle, []
        for warm in idle:
            warm.kill()

    def idle_pids(self) -> list[int]:
        """The pids of the interpreters waiting for a rank."""
        with self._cond:
            return [w.proc.pid for w in self._idle]

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) until ``size`` interpreters have imported torch."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                if sum(w.poll_ready() for w in self._idle) >= self.size:
                    return True
            time.sleep(0.01)
        return False

    def take(self, args: tuple[str, ...], env: dict[str, str], stdout: IO[Any] | None,
             stderr: IO[Any] | None, local_rank: int) -> subprocess.Popen[bytes] | None:
        """torch's worker start (see :func:`ftrun._torch.intercept_worker_starts`): a warm
        interpreter that now runs the rank, or None (logged, an event) to start it cold."""
        parsed = parse_command(args)
        if isinstance(parsed, str):
            return self._cold(local_rank, parsed)
        command, script_args = parsed
        if command != self.command:
            return self._cold(local_rank, f"the worker runs {command}, the pool {self.command}")
        want = start_env(env)
        cwd = os.getcwd()
        with self._cond:
            if self._off is not None:
                return self._cold(local_rank, self._off)
            if cwd != self._cwd or want != self._env:
                why = (f"the working directory is {cwd}, not {self._cwd}" if cwd != self._cwd
                       else env_difference(self._env, want))
                self._env, self._cwd = want, cwd  # the pool's next interpreters match
                self._cond.notify_all()
                return self._cold(local_rank, f"{why}; the pool restarts its interpreters")
            warm = self._pick(script_args)
            self._cond.notify_all()
        if warm is None:
            return self._cold(local_rank, "no warm interpreter left (they are being started)")
        try:
            self._send(warm, command, script_args, env, stdout, stderr)
        except OSError as e:
            warm.kill()
            return self._cold(local_rank, f"warm interpreter {warm.proc.pid} did not take the "
                                          f"request ({e})")
        how = ("parked" if warm.parked is not None else "ready" if warm.ready
               else "still importing")
        log.info("local rank %d runs in warm interpreter %d (%s, started %.1f s ago)",
                 local_rank, warm.proc.pid, how, time.monotonic() - warm.started)
        self._event("worker_warm_start", local_rank=local_rank, pid=warm.proc.pid,
                    ready=warm.ready, parked=warm.parked is not None,
                    age_s=round(time.monotonic() - warm.started, 3))
        return warm.proc

    # -- inside take -----------------------------------------------------------------------

    def _pick(self, script_args: tuple[str, ...]) -> _Warm | None:
        """An idle interpreter that still runs (under the lock): parked with these script
        arguments first, then the ready ones; one parked with others cannot serve."""
        live = [w for w in self._idle if w.proc.poll() is None
                and (w.parked is None or w.parked == script_args)]
        if not live:
            return None
        warm = max(live, key=lambda w: (w.parked is not None, w.poll_ready(), -w.started))
        self._idle.remove(warm)
        return warm

    def _send(self, warm: _Warm, command: WarmCommand, script_args: tuple[str, ...],
              env: dict[str, str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        flags = ["-u", *(["-m"] if command.mode == "module" else [])]
        request = {"env": env, "cwd": os.getcwd(), "argv": list(script_args),
                   "orig_argv": [command.python, *flags, command.target, *script_args]}
        fds = [stdout.fileno() if stdout is not None else 1,
               stderr.fileno() if stderr is not None else 2]
        try:
            socket.send_fds(warm.sock, [json.dumps(request).encode()], fds)
        finally:
            _drain(warm.sock)  # a parked one's "P": unread, closing would reset the request
            warm.sock.close()

    def _cold(self, local_rank: int, why: str) -> None:
        if why not in self._warned:  # the same reason for every rank of a start: log once
            self._warned.add(why)
            log.warning("local rank %d starts cold: %s", local_rank, why)
        self._event("worker_cold_start", local_rank=local_rank, reason=why)
        return None

    def _event(self, type: str, **data: Any) -> None:
        if self._sink is not None:
            self._sink.event(type, **data)

    # -- the pool's thread -----------------------------------------------------------------

    def _run(self) -> None:
        """The pool's thread. It must outlive every rank it started (their parent-death
        signal fires when it ends): an error is logged and the loop goes on until close()."""
        while True:
            try:
                if not self._refill():
                    return
            except Exception:  # noqa: BLE001 - logged; ending would kill the warm ranks
                log.exception("the warm pool failed to refill; retrying in 1 s")
                with self._cond:
                    if not self._closed:
                        self._cond.wait(1.0)

    def _refill(self) -> bool:
        """One round: drop dead and stale interpreters, start one that is missing or wait
        for take() or close(). False once the pool is closed."""
        with self._cond:
            if self._closed:
                return False
            stale = [w for w in self._idle if w.env != self._env or w.cwd != self._cwd
                     or w.proc.poll() is not None
                     or (w.parked is not None and w.parked != self.park_args)]
            for w in stale:
                self._idle.remove(w)
            missing = 0 if self._off else self.size - len(self._idle)
            env, cwd = self._env, self._cwd
            to_park = [w for w in self._idle if w.parked is None and w.poll_ready()] \
                if self.park_args is not None and self._park_off is None else []
            for w in to_park:  # under the lock: take() sends the rank's request after it
                w.parked = self.park_args
                self._park(w, env, cwd)
        for w in stale:
            self._reap(w)
        if missing <= 0:
            with self._cond:
                if not self._closed:
                    # Woken by take() and close(); sooner while an interpreter may become
                    # ready to park.
                    parking = self.park_args is not None and self._park_off is None and any(
                        w.parked is None for w in self._idle)
                    self._cond.wait(0.1 if parking else 1.0)
            return True
        try:
            warm = self._spawn(env, cwd)
        except OSError as e:
            self._turn_off(f"cannot start a warm interpreter: {e}")
            return True
        with self._cond:
            closed = self._closed
            if not closed:
                self._idle.append(warm)
        if closed:
            warm.kill()
            return False
        self._event("warm_spawned", pid=warm.proc.pid)
        return True

    def _spawn(self, env: dict[str, str], cwd: str) -> _Warm:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            cmd = self.command
            proc = subprocess.Popen(
                [cmd.python, "-u", "-c", warm_boot.STUB, str(Path(warm_boot.__file__)),
                 str(theirs.fileno()), str(os.getpid()), cmd.mode, cmd.target,
                 ",".join(self.imports), self.learned],
                env=env, cwd=cwd, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Warm(proc, ours, env, cwd)

    def _park(self, warm: _Warm, env: dict[str, str], cwd: str) -> None:
        """Send a ready interpreter the script's arguments and the job's environment without
        the rank's identity: it runs the script up to its @ftrun.resilient function."""
        assert warm.parked is not None
        flags = ["-u", *(["-m"] if self.command.mode == "module" else [])]
        request = {"park": True, "env": env, "cwd": cwd, "argv": list(warm.parked),
                   "orig_argv": [self.command.python, *flags, self.command.target,
                                 *warm.parked],
                   "hidden": sorted(PER_START)}
        try:
            warm.sock.sendall(json.dumps(request).encode())
        except OSError as e:
            log.warning("warm interpreter %d did not take its parking request (%s)",
                        warm.proc.pid, e)
            return
        self._event("warm_parked", pid=warm.proc.pid)

    def _reap(self, warm: _Warm) -> None:
        """An idle interpreter that died, or one started with an old environment."""
        code = warm.proc.poll()
        if code is None:
            warm.kill()
            return
        if warm.parked is not None:
            warm.sock.close()
            why = (f"parked interpreter {warm.proc.pid} ended before a rank came (exit code "
                   f"{code}; see its output above)")
            log.error("parked workers off: %s; warm interpreters wait with torch imported "
                      "only", why)
            self._event("parked_off", pid=warm.proc.pid, exitcode=code)
            with self._cond:
                self._park_off = why
            return
        ready = warm.poll_ready()
        warm.sock.close()
        if ready or code == 0:
            self._early_deaths = 0
            log.warning("warm interpreter %d exited with code %s while waiting", warm.proc.pid,
                        code)
            return
        self._early_deaths += 1
        log.warning("warm interpreter %d exited with code %s before it was ready (see its "
                    "output above)", warm.proc.pid, code)
        if self._early_deaths >= MAX_EARLY_DEATHS:
            self._turn_off(f"{MAX_EARLY_DEATHS} warm interpreters in a row died before "
                           "they were ready")

    def _turn_off(self, why: str) -> None:
        log.error("warm workers off: %s; workers start cold", why)
        with self._cond:
            self._off = why
            idle, self._idle = self._idle, []
        for warm in idle:
            warm.kill()
