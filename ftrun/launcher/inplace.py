"""In-process restart, the agent's part (a mixin of :class:`ftrun.launcher.agent.FtrunAgent`).

Dead local ranks get new processes alone (from a warm or parked interpreter when there is
one), the others are aborted through their control sockets (:mod:`ftrun.rank.resilient`),
re-rendezvous and get their new world while keeping their processes. At each monitor tick
it tells dead ranks from survivors, and says what happened to them in words and events."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerState,
)

from ftrun import _torch, knobs
from ftrun.coordinator.api import NodeState
from ftrun.errors import FtrunError
from ftrun.launcher.suspect import RankWatch
from ftrun.rank import resilient

log = logging.getLogger("ftrun.launcher.agent")

# How long a rank's control socket may take to acknowledge an order (restart in place).
RANK_REQUEST_TIMEOUT_S = 2.0
# The states of a rank's resilient wrapper in which it can restart in place.
RESTARTABLE = ("running", "failed", "faulted", "aborted")


class InPlaceFailed(Exception):
    """An in-process restart could not finish; the message says why (the fallback's why)."""


def proc_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc (R, S, D, T, t, Z, ...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses; the state follows the last ')'.
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else None


def _not_restartable(worker: Any, alive: bool, state: dict[str, Any] | None,
                     exitcode: int | None = None) -> str | None:
    """Why a local rank cannot restart in place (None: it can): its process has exited
    (``exitcode``, when known), it is not registered by ``@ftrun.resilient``, or it is in a
    state it cannot restart from."""
    if not alive:
        who = f"local rank {worker.local_rank} (rank {worker.global_rank})"
        if exitcode == 0:
            return f"{who} has finished (exit code 0)"
        sig = signal_name(exitcode)
        if sig is not None:
            return f"{who} has died ({sig})"
        if exitcode is not None:
            return f"{who} has exited (exit code {exitcode})"
        return f"{who} has no process"
    if state is None:
        return (f"local rank {worker.local_rank} does not restart in place (its script does "
                "not use ftrun.resilient, or has not reached it yet)")
    if state.get("state") not in RESTARTABLE:
        return f"local rank {worker.local_rank} is {state.get('state')}"
    return None


def signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class InPlaceRestarts:
    """Restart in place: a mixin over the agent's state (``_ctx``, ``_pcontext``, the worker
    group) and torch's agent methods (``worker_pids``, ``rendezvous``)."""

    # A failed restart in place has done the rendezvous already: the fallback starts new
    # processes in that world rather than rendezvousing again.
    _rendezvous_done_for_fallback = False

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        self._phase = NodeState.RESTARTING
        self._ctx.sink.event(
            "restart",
            restart_count=worker_group.spec.max_restarts - self.remaining_restarts(),
            max_restarts=worker_group.spec.max_restarts,
            reason=worker_group.state.name,
        )
        why = self._restart_why or (
            "a new node joins the job" if worker_group.state == WorkerState.HEALTHY
            else f"workers {worker_group.state.name.lower()}")
        detected = self._detected_at or time.monotonic()
        self._restart_why, self._detected_at = None, None
        t0 = time.monotonic()
        cannot = self._cannot_restart_in_place(worker_group)
        if cannot is not None and self._not_in_place is not None:
            cannot = self._not_in_place
        self._not_in_place = None
        if cannot is None:
            try:
                self._restart_in_place(worker_group, why, detected, t0)
                return
            except InPlaceFailed as e:
                how, because = "fallback", str(e)
        else:
            how, because = "new_process", cannot
        # Expected when the script does not use @ftrun.resilient or the feature is off; a
        # failed attempt at restarting in place is worth a warning.
        (log.warning if how == "fallback" else log.info)(
            "restarting the workers as new processes (%s)", because)
        t1 = time.monotonic()
        if self._rendezvous_done_for_fallback:
            self._rendezvous_done_for_fallback = False
            self.stop_workers(worker_group)
            worker_group.state = WorkerState.STOPPED
            self._start_new(worker_group)
        else:
            super().restart_workers(worker_group)
        self._ctx.sink.event(
            "recovery", how=how, why=why, fallback_reason=because,
            detect_s=round(t0 - detected, 3), in_place_s=round(t1 - t0, 3),
            restart_s=round(time.monotonic() - t1, 3),
            total_s=round(time.monotonic() - detected, 3))

    def _control_base(self, local_rank: int) -> str:
        return str(self._ctx.node_dir / f"rank-{local_rank}")

    def _note_restart(self, why: str, evidence_age_s: float = 0.0) -> None:
        """Remember why the workers restart and when the fault's first evidence appeared
        (``evidence_age_s`` before now: a rank's exit or failure report, the wait or the
        silence that named it), which ``recovery.detect_s`` counts from."""
        if self._restart_why is None:
            self._restart_why = why
            self._detected_at = time.monotonic() - max(0.0, evidence_age_s)

    def _rank_states(self, worker_group: WorkerGroup) -> dict[int, dict[str, Any] | None]:
        """Local rank -> its resilient wrapper's state, None where the running process has
        not registered (no state file, or one of an earlier process)."""
        pids = self.worker_pids()
        out: dict[int, dict[str, Any] | None] = {}
        for w in worker_group.workers:
            doc = resilient.read_state(self._control_base(w.local_rank))
            pid = pids.get(w.local_rank)
            out[w.local_rank] = doc if doc is not None and doc.get("pid") == pid else None
        return out

    def _poll_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitor tick, except where dead ranks can be replaced alone.

        torch's context closes every worker as soon as one failed. With in-process restart
        on, ftrun reads the exit codes itself first: a rank that died (exit code other than
        0, or its resilient wrapper reports ``failed`` and is exiting) while every other
        local rank is alive and restartable in place makes the tick UNHEALTHY (a restart,
        counted), with the dead ranks remembered for :meth:`_restart_in_place`. Otherwise
        (no restarts left, a rank that does not restart in place, another torch) torch's
        own tick runs and its failure path takes over as before.
        """
        procs = (_torch.worker_processes(self._pcontext) if self._inplace_timeout_s > 0
                 else None)
        if procs is None:
            return super().monitor_workers(worker_group)
        codes = {lr: p.poll() for lr, p in procs.items()}  # one reading for the whole tick
        states = self._rank_states(worker_group)
        dead = {lr for lr, c in codes.items() if c not in (None, 0)}
        dead |= {lr for lr, doc in states.items()
                 if codes.get(lr) is None and doc is not None and doc.get("state") == "failed"}
        # Ranks whose function raised and that stay to restart in place (NCCL).
        faulted = {lr for lr, doc in states.items() if codes.get(lr) is None
                   and doc is not None and doc.get("state") == "faulted"}
        if faulted and not dead:
            if self.remaining_restarts() > 0 and self._replaceable(
                    worker_group, set(), codes, states) is None:
                self._on_dead_ranks(worker_group, faulted, codes, states, replace=False)
                return RunResult(state=WorkerState.UNHEALTHY)
            self._tell_to_exit(faulted)
            return RunResult(state=WorkerState.HEALTHY)  # torch sees them exit
        if dead:
            cannot = self._replaceable(worker_group, dead, codes, states)
            if self.remaining_restarts() > 0 and cannot is None:
                self._on_dead_ranks(worker_group, dead, codes, states)
                return RunResult(state=WorkerState.UNHEALTHY)
            # torch's failure path stops every worker: say why, not that they are stopped.
            self._not_in_place = cannot
            if any(codes[lr] is None for lr in dead):
                return RunResult(state=WorkerState.HEALTHY)  # torch sees it exit next tick
            return super().monitor_workers(worker_group)
        # Ranks that left the function on their own because a peer went away (a rank of
        # another node died, or its host did): the fault is elsewhere, and waiting for the
        # rendezvous to change could take a node's keep-alive timeout, or forever when the
        # lost node never comes back. Restart in place now: the re-rendezvous forms the new
        # world with whoever is there (spares, --nnodes MIN).
        lost = {lr: doc for lr, doc in states.items() if codes.get(lr) is None
                and doc is not None and doc.get("state") == "aborted"
                and doc.get("generation") == self._generation}
        if lost and self.remaining_restarts() == 0:
            self._tell_to_exit(set(lost))
        elif lost and self._replaceable(worker_group, set(), codes, states) is None:
            by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
            lr, doc = min(lost.items())
            note = str(doc.get("error") or "its peers' collective failed")
            log.warning("rank %d left the training function: a peer went away (%s); "
                        "restarting in place", by_local[lr], note[:300])
            ts = doc.get("ts")  # when the rank saw its peer go: the fault's first evidence here
            age = time.time() - float(ts) if isinstance(ts, (int, float)) else 0.0
            self._note_restart(f"rank {by_local[lr]} lost a peer: {note}"[:300], age)
            self._phase = NodeState.RESTARTING
            return RunResult(state=WorkerState.UNHEALTHY)
        if any(c is None for c in codes.values()):
            return RunResult(state=WorkerState.HEALTHY)  # no exit: torch's poll has nothing
        return super().monitor_workers(worker_group)

    def _tell_to_exit(self, local_ranks: set[int]) -> None:
        """No restart left: ranks waiting for a decision exit with their error (once)."""
        for lr in sorted(local_ranks - self._told_to_exit):
            self._told_to_exit.add(lr)
            self._order(lr, "rank_exit", {"generation": self._generation + 1,
                                          "reason": "no restarts left"})

    def _replaceable(self, worker_group: WorkerGroup, dead: set[int],
                     codes: dict[int, int | None],
                     states: dict[int, dict[str, Any] | None]) -> str | None:
        """Why the dead local ranks cannot get new processes alone while the others restart
        in place (None: they can)."""
        for w in worker_group.workers:
            if w.local_rank not in dead:
                why = _not_restartable(w, codes.get(w.local_rank) is None,
                                       states.get(w.local_rank), codes.get(w.local_rank))
                if why is not None:
                    return why
        return None

    def _on_dead_ranks(self, worker_group: WorkerGroup, dead: set[int],
                       codes: dict[int, int | None],
                       states: dict[int, dict[str, Any] | None], replace: bool = True) -> None:
        """Record the failed ranks (events, last error, why the restart) and remember those
        that get new processes (``replace``: dead ones; not those that stay, ``faulted``)."""
        by_local = {w.local_rank: w for w in worker_group.workers}
        pids = self.worker_pids()
        first: str | None = None
        now = time.time()
        evidence = now
        for lr in sorted(dead, key=lambda lr: (states.get(lr) or {}).get("ts") or 0):
            what = self._record_failure(by_local[lr].global_rank, lr, pids.get(lr),
                                        codes.get(lr), states.get(lr))
            first = first or what
            evidence = min(evidence, self._evidence_time(lr, states.get(lr), now))
        assert first is not None
        self._last_error = first[:1024]
        self._note_restart(first[:300], now - evidence)
        self._replace = set(dead) if replace else set()
        self._phase = NodeState.RESTARTING

    def _evidence_time(self, lr: int, doc: dict[str, Any] | None, now: float) -> float:
        """When (wall clock) the fault of dead local rank ``lr`` first showed: its failure
        report, the last progress of a rank killed as hung, else now (its exit, seen)."""
        hung = self._hung_killed.get(lr)
        if hung is not None:
            return min(now, hung[1])
        ts = (doc or {}).get("ts")
        if (doc or {}).get("state") in ("failed", "faulted") and isinstance(ts, (int, float)):
            return min(now, float(ts))
        return now

    def _record_failure(self, rank: int, lr: int, pid: int | None, code: int | None,
                        doc: dict[str, Any] | None) -> str:
        """Record a dead rank (its exit code, event ``worker_failure``); returns what
        happened to it in words."""
        sig = signal_name(code)
        hung = self._hung_killed.get(lr)
        if hung is not None:
            what = f"rank {rank} hung ({hung[0]}): killed"
        elif doc is not None and doc.get("state") in ("failed", "faulted"):
            what = f"rank {rank} failed: {doc.get('error')}"
        elif sig is not None:
            what = f"rank {rank} died ({sig})"
        else:
            what = f"rank {rank} died (exit code {code})"
        if code is not None:
            self._exitcodes[lr] = code
        self._ctx.sink.event("worker_failure", rank=rank, local_rank=lr, pid=pid,
                             exitcode=code, signal=sig,
                             message=str((doc or {}).get("error") or what)[:4096],
                             timestamp=time.time(), in_place=True,
                             step=self._current_step(lr), step_s=self.step_time_s(lr))
        return what

    def _note_died_meanwhile(self, worker_group: WorkerGroup, local_ranks: set[int]) -> None:
        """Ranks that did not answer the abort because they had died meanwhile (a rank that
        exits as another's failure is being handled): their failure is recorded like any
        other (``worker_failure``). A live one is killed for not answering, logged."""
        procs = _torch.worker_processes(self._pcontext) or {}
        by_local = {w.local_rank: w for w in worker_group.workers}
        for lr in sorted(local_ranks):
            proc = procs.get(lr)
            code = proc.poll() if proc is not None else None
            if proc is not None and code is not None:
                self._record_failure(by_local[lr].global_rank, lr, proc.pid, code, None)

    def _cannot_restart_in_place(self, worker_group: WorkerGroup) -> str | None:
        """Why the workers cannot restart in place (None: they can)."""
        if self._inplace_timeout_s <= 0:
            return "in-process restart is off (FTRUN_INPLACE_TIMEOUT=0)"
        pids = self.worker_pids()
        if not pids:
            return "no workers run"
        if _torch.worker_processes(self._pcontext) is None and self._replace:
            return "torch's process context cannot replace one worker (see the log)"
        states = self._rank_states(worker_group)
        procs = _torch.worker_processes(self._pcontext) or {}
        for w in worker_group.workers:
            if w.local_rank in self._replace:
                continue  # dead: it gets a new process
            pid = pids.get(w.local_rank)
            proc = procs.get(w.local_rank)
            why = _not_restartable(w, pid is not None and proc_state(pid) not in
                                   (None, "Z", "X"), states.get(w.local_rank),
                                   proc.poll() if proc is not None else None)
            if why is not None:
                return why
        return None

    def _order(self, local_rank: int, kind: str, body: dict[str, Any],
               quiet: bool = False) -> bool:
        """Send one order to a rank's control socket; False (logged) when not acknowledged."""
        from ftrun.protocol.transport import Client

        secret = self._ctx.worker_env.get(knobs.SECRET.name) or knobs.SECRET.get()
        client = Client(resilient.control_url(self._control_base(local_rank)), secret.encode(),
                        self._ctx.worker_env.get(knobs.RUN_ID.name) or knobs.RUN_ID.get(),
                        f"launcher/{os.getpid()}", peer=f"local rank {local_rank}")
        try:
            client.request(kind, body, "ack", RANK_REQUEST_TIMEOUT_S)
            return True
        except FtrunError as e:
            (log.info if quiet else log.warning)("%s to local rank %d: %s", kind, local_rank, e)
            return False
        finally:
            client.close()

    def _wait_ranks(self, worker_group: WorkerGroup, local_ranks: set[int],
                    ok: Callable[[dict[str, Any]], bool]) -> set[int]:
        """Wait (bounded by FTRUN_INPLACE_TIMEOUT) until the state of each of ``local_ranks``
        satisfies ``ok``; returns those that did not (late, or dead)."""
        deadline = time.monotonic() + self._inplace_timeout_s
        while True:
            states = self._rank_states(worker_group)
            late = {lr for lr in local_ranks if states.get(lr) is None or not ok(states[lr])}
            if not late or time.monotonic() >= deadline:
                return late
            time.sleep(0.01)

    def _reap(self, local_ranks: set[int], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the processes of ``local_ranks`` to exit; SIGKILL
        (and reap) those still running then: a rank that does not leave is as dead."""
        procs = _torch.worker_processes(self._pcontext) or {}
        deadline = time.monotonic() + timeout_s
        for lr in sorted(local_ranks):
            proc = procs.get(lr)
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if timeout_s > 0:  # 0: the caller said why it kills them
                    log.warning("local rank %d (pid %d) did not exit within %.1f s; killing "
                                "it", lr, proc.pid, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # torch starts it in its own session
                proc.wait(RANK_REQUEST_TIMEOUT_S)

    def _kill_stopped(self, worker_group: WorkerGroup, local_ranks: set[int],
                      why: str) -> set[int]:
        """SIGKILL those of ``local_ranks`` whose process is stopped (state T or t); returns
        them."""
        pids = self.worker_pids()
        killed = set()
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if w.local_rank not in local_ranks or pid is None or proc_state(pid) not in ("T", "t"):
                continue
            log.error("rank %d (local %d, pid %d) is stopped and cannot leave the training "
                      "function: killing it for a new process (%s)", w.global_rank,
                      w.local_rank, pid, why)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(w.local_rank)
            self._ctx.sink.event("stopped_rank_killed", rank=w.global_rank,
                                 local_rank=w.local_rank, pid=pid, why=why)
        return killed

    def _restart_in_place(self, worker_group: WorkerGroup, why: str, detected: float,
                          t0: float) -> None:
        """Restart in place: the dead local ranks (``self._replace``) get new processes,
        the survivors are aborted, re-rendezvous, get their new world and keep their
        processes. A survivor that does not leave the training function within
        FTRUN_INPLACE_TIMEOUT (blocked inside a C call) is killed and replaced too. Raises
        InPlaceFailed (the caller falls back to new processes for all)."""
        gen = self._generation + 1
        old = self._generation
        dead = set(self._replace)
        self._replace = set()
        survivors = {w.local_rank for w in worker_group.workers} - dead
        # A stopped rank (SIGSTOP) cannot leave the function: it is dead, whatever found the
        # fault. Killed now, it gets a new process rather than costing the abort's timeout.
        stopped = self._kill_stopped(worker_group, survivors, why)
        dead |= stopped
        survivors -= stopped
        silent = set()
        for lr in sorted(survivors):
            if not self._order(lr, "rank_abort", {"generation": gen, "reason": why}):
                log.warning("local rank %d did not acknowledge rank_abort: replacing it", lr)
                silent.add(lr)
        self._note_died_meanwhile(worker_group, silent)
        dead |= silent
        survivors -= dead
        self._reap(dead, self._inplace_timeout_s)  # their exit releases the survivors (gloo)
        late = self._wait_ranks(worker_group, survivors, lambda d: d.get("state") in (
            "failed", "faulted", "aborted") and d.get("generation") == old)
        if late:
            log.warning("local rank(s) %s did not leave the training function within %.1f s: "
                        "killing them for new processes", sorted(late), self._inplace_timeout_s)
            self._reap(late, 0.0)
            dead |= late
            survivors -= late
        t_abort = time.monotonic()
        world = self._new_world(worker_group)  # ranks, world size, master address and port
        t_rdzv = time.monotonic()
        self._rendezvous_done_for_fallback = True
        self._generation = gen  # a new process joins this generation (FTRUN_RANK_GENERATION)
        pids = self.worker_pids()
        for w in worker_group.workers:
            if w.local_rank not in survivors:
                continue
            w.id = pids.get(w.local_rank)
            env = _torch.worker_env(self, worker_group, w)
            if not self._order(w.local_rank, "rank_world", {"generation": gen, "env": env}):
                self._generation = old
                raise InPlaceFailed(f"local rank {w.local_rank} did not acknowledge rank_world")
        for w in worker_group.workers:
            if w.local_rank not in dead:
                continue
            base = self._control_base(w.local_rank)
            for path in (base + resilient.STATE_SUFFIX, base + resilient.SOCKET_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            env = {**self._ctx.worker_env, **_torch.worker_env(self, worker_group, w)}
            try:
                w.id = _torch.replace_worker(self._pcontext, w.local_rank, env)
            except (_torch.SeamMissing, RuntimeError, OSError) as e:
                self._generation = old
                raise InPlaceFailed(f"cannot start a new process for local rank "
                                    f"{w.local_rank}: {e}") from e
            pids[w.local_rank] = w.id
        late = self._wait_ranks(worker_group, survivors, lambda d: d.get("generation") == gen
                                and d.get("state") in ("running", "done"))
        if late:
            self._generation = old
            raise InPlaceFailed(f"local rank(s) {sorted(late)} did not run the function again "
                                f"within {self._inplace_timeout_s:g} s")
        self._rendezvous_done_for_fallback = False
        t_world = time.monotonic()
        self._exitcodes.clear()
        self._hung_killed = {}
        self._watches = {w.local_rank: RankWatch(self._rule) for w in worker_group.workers}
        self._verdicts = {}
        worker_group.state = WorkerState.HEALTHY
        self._phase = NodeState.HEALTHY
        restart_count = worker_group.spec.max_restarts - self.remaining_restarts()
        by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
        self._ctx.sink.event(
            "workers_started", restart_count=restart_count, in_place=True,
            pids={str(k): v for k, v in pids.items()},
            ranks=[w.global_rank for w in worker_group.workers],
            new_processes=sorted(by_local[lr] for lr in dead))
        self._ctx.sink.event(
            "recovery", how="in_process", why=why, generation=gen, restart_count=restart_count,
            new_processes=sorted(by_local[lr] for lr in dead),
            kept=sorted(by_local[lr] for lr in survivors),
            stopped_killed=sorted(by_local[lr] for lr in stopped), world=world,
            detect_s=round(t0 - detected, 3), abort_s=round(t_abort - t0, 3),
            rendezvous_s=round(t_rdzv - t_abort, 3), world_s=round(t_world - t_rdzv, 3),
            total_s=round(t_world - detected, 3))
        log.warning("workers restarted in place (generation %d, %.3f s: abort %.3f s, "
                    "%s %.3f s, world %.3f s; new processes for rank(s) %s): %s", gen,
                    t_world - detected, t_abort - t0,
                    "votes" if world == "pushed" else "rendezvous", t_rdzv - t_abort,
                    t_world - t_rdzv,
                    sorted(by_local[lr] for lr in dead) or "none", why)

    def _start_new(self, worker_group: WorkerGroup) -> None:
        """New processes for a group whose rendezvous is done (torch's
        ``_initialize_workers`` after its rendezvous)."""
        pids = self.start_workers(worker_group)
        for local_rank, pid in pids.items():
            worker_group.workers[local_rank].id = pid
        worker_group.state = WorkerState.HEALTHY
