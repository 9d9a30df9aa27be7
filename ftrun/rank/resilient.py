"""In-process restart: ``@ftrun.resilient`` runs the training function again after a fault.

Under an ftrun launcher that restarts ranks in place (it sets ``FTRUN_RANK_CONTROL``), the
wrapper keeps the process, its imports and its CUDA context across faults:

1. It serves a control socket (``<FTRUN_RANK_CONTROL>.sock``, signed with the job secret
   like every ftrun message) on a thread of its own, and keeps a state file
   (``<FTRUN_RANK_CONTROL>.json``: pid, generation, state, error) that tells the launcher
   this rank can restart in place and where it stands: ``running``, ``failed`` (the
   function raised on its own and the process exits), ``faulted`` (it raised on its own and
   the process stays), ``aborted`` (it left on the launcher's order) or ``done``.
2. ``rank_abort`` (another rank failed, a hang, a new member): the process groups are
   aborted and an exception (:class:`RankAborted`) is raised into the thread that runs the
   function, which unwinds it. A thread blocked inside a C call sees it only when that call
   returns: on NCCL the abort releases it; on gloo, whose abort does not, the connections
   the function's groups accepted are shut down (:mod:`ftrun.rank.sockets`), which
   releases this rank and the peers blocked on it; a rank that never comes back is the
   launcher's to kill (a new process for it after its deadline).
3. The function raised on its own. Where something other than its exit releases the peers
   blocked in a collective with it, the rank keeps its process (``faulted``) and restarts in
   place with the others: on NCCL (its abort), and on gloo when the whole world is on this
   node (its launcher aborts every other rank, and every rank shuts down the connections it
   accepted), unless the error may have left the device unusable (a CUDA error). Otherwise
   (gloo with ranks on other nodes) the rank is dead: the error goes to the state file
   (``failed``) and is raised again, so the process exits, which closes its connections and
   releases its peers; its launcher starts a new process for this rank alone.
4. The function failed because a peer went away (a lost-connection error from a
   collective, see :func:`peer_lost`) or was aborted: everything it built is released
   (process groups aborted and forgotten, its frames' locals cleared, the collective monitor
   stopped, a garbage collection) and the rank waits, bounded by ``FTRUN_INPLACE_WAIT``, for
   its launcher's decision: ``rank_world`` (the new world's RANK, WORLD_SIZE, MASTER_ADDR,
   MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...: applied to ``os.environ``) and the function
   runs again; ``rank_exit``, or no decision in time, and :class:`FtrunError` is raised.
   Before it runs again, the hooks registered with :func:`before_rerun` run: a framework
   integration resets there what its framework keeps for the whole process (accelerate's
   ``PartialState`` caches the old world and would not join the new one).

Without ``FTRUN_RANK_CONTROL`` (plain ``python``, ``torchrun``, a launcher that does not
restart in place) the wrapper calls the function once and returns what it returns.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from ftrun import _torch, knobs
from ftrun.errors import FtrunError
from ftrun.rank import sockets

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Sent to the function's (main) thread after the exception is scheduled: a thread waiting in
# a C call that retries after signals (lock and Event waits, sleep, most system calls) runs
# the handler, and so raises the exception there. A real-time signal: no user's handler.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 4
SOCKET_SUFFIX = ".sock"
STATE_SUFFIX = ".json"


class RankAborted(BaseException):  # noqa: N818 - the name says what happened
    """Raised into the training function's thread when the launcher aborts this rank for an
    in-process restart. A ``BaseException``, so that the function's own ``except Exception``
    does not catch it."""


def control_url(base: str) -> str:
    """The ipc URL of the control socket of the rank whose FTRUN_RANK_CONTROL is ``base``
    (Linux's abstract namespace where the path is too long for a socket)."""
    path = base + SOCKET_SUFFIX
    if len(path) <= 100:
        return f"ipc://{path}"
    import hashlib

    return f"ipc://@ftrun-{os.getuid()}-{hashlib.sha1(path.encode()).hexdigest()[:16]}"


def read_state(base: str) -> dict[str, Any] | None:
    """The rank's state file (None while there is none or it cannot be read)."""
    try:
        with open(base + STATE_SUFFIX, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_state(base: str, doc: dict[str, Any]) -> None:
    tmp = f"{base}{STATE_SUFFIX}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, base + STATE_SUFFIX)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: cancel a pending
    one) via ``PyThreadState_SetAsyncExc``."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


class _Decision:
    """What the launcher said after the function left: a world to run in, or exit."""

    def __init__(self, generation: int, env: dict[str, str] | None, reason: str = "") -> None:
        self.generation = generation
        self.env = env
        self.reason = reason


class RankControl:
    """The rank's end of in-process restart: the control service and the state file.

    ``enter``/``leave`` bracket each call of the training function on its thread; the
    service's handlers (on the control thread) abort a running function, and hand a world
    or an exit to :meth:`wait_decision`.
    """

    def __init__(self, base: str, secret: bytes, run_id: str) -> None:
        from ftrun.protocol.service import Service
        from ftrun.protocol.transport import Server

        self.base = base
        # The launcher's count of restarts in place of the world this process runs in (a
        # process started for a dead rank joins a later generation).
        try:
            self.generation = max(0, int(knobs.RANK_GENERATION.get() or 0))
        except ValueError:
            self.generation = 0
        self._cond = threading.Condition()
        self._running = False
        self._async_pending = False
        self._thread_id: int | None = None
        self._abort_generation = 0
        self._abort_reason = ""
        self._decision: _Decision | None = None
        self._backend: str | None = None
        self._handler = False
        self.sockets_before: set[int] = set()
        server = Server("rank control", secret, run_id,
                        {"rank_abort": self._on_abort, "rank_world": self._on_world,
                         "rank_exit": self._on_exit},
                        sender=f"rank/{os.getpid()}", typed=True, hwm=64)
        self.service = Service(server, poll_s=0.05, max_messages=16,
                               thread_name="ftrun-rank-control")
        for path in (base + SOCKET_SUFFIX,):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.service.bind(control_url(base))
        self.service.start()

    # -- the function's thread --------------------------------------------------------------

    def enter(self) -> None:
        if threading.current_thread() is threading.main_thread() and not self._handler:
            signal.signal(INTERRUPT_SIGNAL, _on_interrupt)
            self._handler = True
        self.sockets_before = sockets.socket_inodes()  # gloo's will be the ones added
        with self._cond:
            self._thread_id = threading.get_ident()
            self._running = True
            self._async_pending = False
        self._state("running")

    def leave(self) -> None:
        """The function returned or raised: no abort may reach this thread any more
        (idempotent; one scheduled but not yet raised is cancelled)."""
        with self._cond:
            if self._running and self._async_pending and self._thread_id is not None:
                _async_raise(self._thread_id, None)
            self._running = False
            self._async_pending = False

    def aborting(self) -> bool:
        """Whether the launcher ordered an abort of the generation now running."""
        with self._cond:
            return self._abort_generation > self.generation

    def abort_reason(self) -> str:
        with self._cond:
            return self._abort_reason

    def note_backend(self) -> None:
        """Remember the job's backend while its group exists (NCCL aborts in the
        background)."""
        if "torch.distributed" in sys.modules:
            try:
                self._backend = _torch.default_backend() or self._backend
            except Exception:  # noqa: BLE001 - only a hint
                pass

    def wait_decision(self, state: str, error: str | None, timeout_s: float) -> _Decision | None:
        """Report ``state`` (failed | aborted) and wait up to ``timeout_s`` for a world
        newer than the one that ran, or an exit; None when none came."""
        self._state(state, error)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                d = self._decision
                if d is not None and (d.env is None or d.generation > self.generation):
                    self._decision = None
                    if d.env is not None:
                        self.generation = d.generation
                    return d
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))

    def done(self) -> None:
        self._state("done")

    def failed(self, error: str) -> None:
        """The function raised on its own: this process exits with its error."""
        self._state("failed", error)

    def close(self) -> None:
        self.service.stop(2.0)
        try:
            os.unlink(self.base + SOCKET_SUFFIX)
        except FileNotFoundError:
            pass

    def _state(self, state: str, error: str | None = None) -> None:
        doc = {"pid": os.getpid(), "generation": self.generation, "state": state,
               "error": error, "ts": time.time()}
        try:
            _write_state(self.base, doc)
        except OSError as e:
            log.warning("cannot write the in-process restart state file %s: %s", self.base, e)

    # -- the control thread -------------------------------------------------------------------

    def _on_abort(self, msg: Any) -> Any:
        from ftrun.protocol.messages import Ack

        body = msg.body
        self._abort(body.generation, body.reason)
        return Ack()

    def _abort(self, generation: int, reason: str) -> None:
        with self._cond:
            if generation <= self._abort_generation or generation <= self.generation:
                return
            self._abort_generation = generation
            self._abort_reason = reason
            interrupt = self._running and not self._async_pending
            if interrupt:
                self._async_pending = True
            self._cond.notify_all()
        if not interrupt:
            return
        log.warning("aborting the training function for an in-process restart (generation "
                    "%d): %s", generation, reason)
        # NCCL: an abort releases a collective blocked on the GPU. gloo: it does not (the
        # blocked call returns when a peer's connections close), so it is left to the
        # function's thread, which aborts once it is out.
        backend = _torch.default_backend() if "torch.distributed" in sys.modules else None
        if backend == "nccl":
            try:
                _torch.abort_process_groups()
            except Exception as e:  # noqa: BLE001 - the main thread aborts again after
                log.warning("aborting the process groups from the control thread failed: "
                            "%s: %s", type(e).__name__, e)
        with self._cond:
            if self._running and self._thread_id is not None:
                _async_raise(self._thread_id, RankAborted)
                if self._handler and self._thread_id == threading.main_thread().ident:
                    signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)
        if backend is not None and backend != "nccl":
            # gloo: closing the group's connections releases a collective blocked in them
            # (this rank's, and its peers' blocked on this rank).
            _close_connections(self.sockets_before)

    def _on_world(self, msg: Any) -> Any:
        from ftrun.protocol.messages import Ack

        body = msg.body
        with self._cond:
            running = self._running
        if running:  # a world while the function still runs aborts it first
            self._abort(body.generation, "a new world arrived")
        with self._cond:
            if body.generation > self.generation:
                self._decision = _Decision(body.generation, dict(body.env))
                self._cond.notify_all()
        return Ack()

    def _on_exit(self, msg: Any) -> Any:
        from ftrun.protocol.messages import Ack

        with self._cond:
            self._decision = _Decision(msg.body.generation, None, msg.body.reason)
            self._cond.notify_all()
        return Ack()


def _on_interrupt(signum: int, frame: Any) -> None:
    """INTERRUPT_SIGNAL's handler: running it is the point (the pending RankAborted is raised
    as it runs)."""


def _close_connections(before: set[int]) -> None:
    """Shut down the connections the function's gloo groups accepted (see
    :mod:`ftrun.rank.sockets`); the job store's port is left alone."""
    try:
        port: int | None = int(os.environ.get("MASTER_PORT", ""))
    except ValueError:
        port = None
    n = sockets.shut_down_accepted(before, port)
    if n:
        log.info("closed %d connection(s) of the aborted process groups", n)


def _release(backend: str | None, sockets_before: set[int]) -> None:
    """Release what the function built (its Snapshotters went first, see
    :func:`_abandon_snapshots`): every process group, aborted and forgotten (NCCL: the slow
    abort runs on a thread while the next group forms), then collect garbage so that DDP
    modules, groups and their connections go now. The collective monitor stops: it
    watched the old world's groups (the next Snapshotter starts one for the new world)."""
    _stop_monitor()
    join_aborts(ABORT_JOIN_S)
    if "torch.distributed" in sys.modules:
        try:
            if backend == "nccl":
                abort = _torch.detach_process_groups()
                thread = threading.Thread(target=_abort_quietly, args=(abort,), daemon=True,
                                          name="ftrun-pg-abort")
                thread.start()
                _ABORTS.append(thread)
            else:
                _close_connections(sockets_before)  # releases peers blocked on this rank
                _torch.abort_process_groups()
        except Exception as e:  # noqa: BLE001 - the next init_process_group says more
            log.warning("could not abort the process groups: %s: %s", type(e).__name__, e)
    gc.collect()


# Detached NCCL groups being aborted on threads of their own. Each is joined before the
# process exits: a ProcessGroupNCCL still aborting when the interpreter exits ends the
# process in std::terminate (SIGABRT; seen on H100, torch 2.11), which the launcher would
# take for a failed rank.
_ABORTS: list[threading.Thread] = []
ABORT_JOIN_S = 60.0  # how long the exit (or the next release) waits for a pending abort


def join_aborts(timeout_s: float) -> None:
    """Wait (bounded) for the pending aborts of detached process groups."""
    deadline = time.monotonic() + timeout_s
    while _ABORTS:
        thread = _ABORTS[0]
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("an aborted NCCL process group is still being torn down after %.0f s",
                        timeout_s)
            return
        _ABORTS.pop(0)


def _abandon_snapshots() -> None:
    """Release the aborted function's Snapshotters while its frames still hold them: pinned
    pages must be unpinned before their mappings go, or the next run's cannot be pinned."""
    if "ftrun.rank.snapshotter" not in sys.modules:
        return
    try:
        from ftrun.rank.snapshotter import abandon_all

        abandon_all()
    except Exception as e:  # noqa: BLE001 - never in the way of a restart
        log.warning("could not release the snapshotters: %s: %s", type(e).__name__, e)


def _stop_monitor() -> None:
    try:
        from ftrun.rank.collectives import stop_monitor

        stop_monitor()
    except Exception as e:  # noqa: BLE001 - never in the way of a restart
        log.warning("could not stop the collective monitor: %s: %s", type(e).__name__, e)


def _abort_quietly(abort: Callable[[], None]) -> None:
    try:
        abort()
    except Exception as e:  # noqa: BLE001 - the groups are forgotten already
        log.warning("aborting the old process groups failed: %s: %s", type(e).__name__, e)


# What gloo (and the c10d store) raise in a rank blocked in a collective with a peer whose
# process exited: the peer's fault, not this rank's.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "connection refused", "socket closed", "econnreset", "epipe",
              "communicator was aborted", "was aborted", "remote worker crash")


# A DistError that is this rank's own: its store could not listen on MASTER_PORT (taken on
# this host). No peer went away; the rank fails, and its new process gets a new port.
_OWN_DIST_ERROR = ("failed to listen", "eaddrinuse", "address already in use")


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is a collective failing because a peer
    went away: torch's DistError family, or a gloo/NCCL message saying so (not a store that
    could not listen here)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur).lower()
        if any(p in text for p in _OWN_DIST_ERROR):
            return False
        dist = sys.modules.get("torch.distributed")
        dist_error = getattr(dist, "DistError", None) if dist is not None else None
        if isinstance(dist_error, type) and isinstance(cur, dist_error):
            return True
        if any(p in text for p in _PEER_LOST):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


# A CUDA error leaves the device context unusable (sticky errors: an illegal address, a
# device-side assert): such a rank cannot run again in its process.
_CONTEXT_LOST = ("cuda error", "cudaerror", "device-side assert", "illegal memory access",
                 "an illegal instruction", "cublas_status", "cudnn_status", "out of memory")


def _keeps_process(backend: str | None, e: BaseException, world_local: bool = False) -> bool:
    """Whether a rank whose function raised ``e`` on its own can run again in its process:
    when something other than its exit releases the peers blocked with it, unless the error
    may have left the device unusable. On NCCL its abort does. On gloo (or before any group
    exists) only when the whole world is on this node (``world_local``): its launcher then
    aborts every other rank, and each one, this one included, shuts down the connections it
    accepted (:mod:`ftrun.rank.sockets`), which closes every pair of the group from one end.
    With ranks on other nodes, a pair whose remote end accepted would stay open (that rank's
    launcher is not told): the rank exits, which closes all of them."""
    if backend != "nccl" and not world_local:
        return False
    accel = getattr(sys.modules.get("torch"), "AcceleratorError", None)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(accel, type) and isinstance(cur, accel):
            return False
        if isinstance(cur, MemoryError) or any(p in str(cur).lower() for p in _CONTEXT_LOST):
            return False
        cur = cur.__cause__ or cur.__context__
    return True


def _world_is_local() -> bool:
    """Whether every rank of the current world runs under this rank's launcher (torch's
    elastic environment: WORLD_SIZE equals LOCAL_WORLD_SIZE)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    return bool(world) and world == local


# Called, in order of registration, before each run of a resilient function after the first
# in this process; keyed by name so that an integration imported twice registers once.
_RERUN_HOOKS: dict[str, Callable[[], None]] = {}


def before_rerun(name: str, hook: Callable[[], None]) -> None:
    """Have ``hook()`` run before the training function runs again in place, after the old
    world's process groups are gone and the new world's environment is set.

    For state a framework keeps for the whole process rather than in the objects the
    function builds (a singleton that caches the process group, the rank, the world size),
    which would otherwise outlive the world it describes. ``name`` identifies the hook: a
    second registration under the same name replaces the first.
    """
    _RERUN_HOOKS[name] = hook


def _run_rerun_hooks() -> None:
    for name, hook in list(_RERUN_HOOKS.items()):
        try:
            hook()
        except Exception as e:
            raise FtrunError(f"the in-place restart's reset of {name} failed: "
                             f"{type(e).__name__}: {e}") from e


def _summary(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-4000:]


def _control_from_env() -> RankControl | None:
    base = knobs.RANK_CONTROL.get()
    if not base:
        return None
    secret = knobs.SECRET.get().encode()
    if not secret:
        log.warning("%s is set but %s is not: in-process restart is off",
                    knobs.RANK_CONTROL.name, knobs.SECRET.name)
        return None
    try:
        return RankControl(base, secret, knobs.RUN_ID.get())
    except FtrunError as e:
        log.warning("in-process restart is off (a fault restarts this process): %s", e)
        return None


def _wait_s() -> float:
    try:
        return max(0.0, float(knobs.INPLACE_WAIT.get()))
    except ValueError:
        return float(knobs.INPLACE_WAIT.default)


def _unpark() -> None:
    """In a parked warm interpreter (FTRUN_PARKED_WORKERS: it ran the script up to here
    without a rank; ftrun.launcher.warm_boot), wait for the rank it becomes: its environment
    and streams. A no-op anywhere else."""
    parked = sys.modules.get("_ftrun_parked")
    if parked is not None:
        parked.unpark()


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)``; under a launcher that restarts in place, call it again
    after each fault of the job, in the new world, until it returns (see the module's
    docstring). Returns what ``fn`` returns; raises its error when the launcher says exit."""
    _unpark()
    control = _control_from_env()
    if control is None:
        return fn(*args, **kwargs)
    try:
        while True:
            note: str | None = None  # why a survivor left: a peer's failure it saw
            try:
                try:
                    control.enter()
                    result = fn(*args, **kwargs)
                finally:
                    control.note_backend()
                    control.leave()
            except RankAborted:
                _abandon_snapshots()
                state = "aborted"
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - reported, then raised or run again
                control.leave()
                if control.aborting():
                    state = "aborted"  # an error the abort caused (a failed collective)
                elif peer_lost(e):
                    # A peer died (its exit closed the connections this rank's collective
                    # used): the launcher restarts the job in place, keeping this process.
                    state, note = "aborted", _summary(e)
                    log.warning("a collective failed because a peer went away (%s); waiting "
                                "for the launcher's decision", note)
                elif _keeps_process(control._backend, e, _world_is_local()):
                    # This rank's own fault, where something else than its exit releases
                    # the peers (NCCL's abort; on one node, the connections every rank
                    # shuts down): the process stays, like every other rank's; the launcher
                    # restarts the whole job in place.
                    state, note = "faulted", _summary(e)
                    log.error("the training function failed (%s); this process stays and "
                              "waits for the launcher's decision (%s aborts its peers)",
                              note, control._backend)
                else:
                    # This rank's own fault: it is dead. Its process exits, which closes its
                    # connections (on gloo nothing else does) and so releases every peer
                    # blocked in a collective with it; the launcher gives this rank a new
                    # process and the others restart in place.
                    control.failed(_summary(e))
                    log.error("the training function failed (%s); this process exits and "
                              "its launcher starts a new one for this rank", _summary(e))
                    _abandon_snapshots()  # no snapshot wait may hold the exit
                    _stop_monitor()
                    raise
                # Drop every frame's locals (the model, DDP, the groups they hold), once
                # the Snapshotters among them are released.
                _abandon_snapshots()
                if e.__traceback__ is not None:
                    traceback.clear_frames(e.__traceback__)
            else:
                control.done()
                return result
            _release(control._backend, control.sockets_before)
            t0 = time.monotonic()
            decision = control.wait_decision(state, note, _wait_s())
            if decision is None or decision.env is None:
                why = "no decision from the launcher" if decision is None else decision.reason
                raise FtrunError(f"the training function was aborted for an in-process "
                                 f"restart and not run again: {why}")
            os.environ.update(decision.env)
            log.warning("running the training function again in place (generation %d, rank "
                        "%s of %s, waited %.3f s for the new world)", decision.generation,
                        decision.env.get("RANK"), decision.env.get("WORLD_SIZE"),
                        time.monotonic() - t0)
            _run_rerun_hooks()
    finally:
        join_aborts(ABORT_JOIN_S)
        control.close()


def resilient(fn: F) -> F:
    """Decorate the training function so that a fault restarts it in this process.

    ``@ftrun.resilient def main(): ...``; calling ``main()`` runs it under :func:`run`.
    The function must tolerate running again: it initialises the process group, builds its
    model and restores from the snapshot itself, and keeps no state in globals or mutable
    arguments that a second run would see half-changed.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run(fn, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
