"""``FtrunAgent``: torchrun's ``LocalElasticAgent`` with ftrun's additions.

The rendezvous, the worker environment, restarts and the failure summary are torch's own.
This subclass adds, at the agent's existing extension points (private in torch; ftrun reaches
them through :func:`ftrun._torch.agent_class`, under public names):

- workers tied to the launcher's life (parent-death signal), so ``kill -9`` of the launcher
  leaves no orphans;
- a per-rank progress file and a hang check: a rank that stops reporting progress, or sits
  stopped (SIGSTOP), for ``--hang-timeout`` seconds is killed and the group restarted;
- a per-rank health verdict (:mod:`ftrun.launcher.suspect`): a stopped or silent rank is
  reported ``suspect`` at once, long before it is killed;
- a prompt stop of frozen workers: SIGTERM stays pending on a stopped process, which made
  torchrun wait out its whole shutdown timeout, so stopped workers get SIGKILL at once;
- a lost member caught at once: a node that the c10d rendezvous dropped for missed
  keep-alives (its host died or its link was cut) restarts the workers of the survivors,
  which would otherwise wait in a collective for the process-group timeout; a node that
  finds itself dropped restarts its own workers and rejoins the job rather than training on;
- reports to the coordinator: node state for the heartbeat, and events for rendezvous,
  starts, failures, hangs, dropped nodes and restarts;
- the coordinator's directives, queued by the node reporter's thread and carried out on the
  agent's own thread at its next monitor tick: ``restart`` SIGKILLs the named local ranks
  (torch's failure path restarts the group; a rank stuck in a collective dies at once),
  ``isolate`` SIGKILLs every worker and raises :class:`HostIsolated`, which ends the
  launcher without closing the rendezvous for the other nodes, and ``probe`` starts the
  link probes on a thread of their own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

from ftrun import _torch, knobs
from ftrun.coordinator.api import NodeState, SuspectCause
from ftrun.errors import FtrunError
from ftrun.launcher.store_proc import StoreProcess
from ftrun.launcher.suspect import NOT_WATCHED, RankWatch, SuspectRule, Verdict
from ftrun.launcher.warm import WarmPool, auto_warm
from ftrun.pdeath import tie_entrypoint
from ftrun.rank import resilient
from ftrun.rank.progress import (
    Progress,
    create_progress_file,
    read_progress,
    read_stacks,
    request_stacks,
)

log = logging.getLogger(__name__)

# A rank frozen by SIGSTOP blocks every collective; with --hang-timeout off it is still
# killed after this long.
STOPPED_LIMIT_S = 10.0
# --hang-timeout: a rank blocked in a collective (its monitor says since when) is a victim
# waiting for a peer; it is killed only once its wait passes this many hang timeouts.
VICTIM_FACTOR = 2.0
STACKS_WAIT_S = 0.5  # from asking a suspect rank for its stacks to logging them
# A member of the round missing from the rendezvous state for this long was dropped for
# missed keep-alives: a node that restarts leaves the round and enters the wait list in
# consecutive syncs, well within it.
DROPPED_GRACE_S = 2.0
# How long an isolated node tries to leave its rendezvous round before it exits anyway.
LEAVE_TIMEOUT_S = 5.0
# How long a rank's control socket may take to acknowledge an order (restart in place).
RANK_REQUEST_TIMEOUT_S = 2.0
# How long a survivor tries to take a lost node out of the rendezvous state.
DROP_TIMEOUT_S = 5.0
# A lost node's c10d keep-alive may be this much younger than the silence the coordinator
# measured (its last heartbeat may precede its last keep-alive by an interval; clocks differ
# a little) and the node still count as lost; a younger one reached the rendezvous after its
# launcher went silent to the coordinator: not lost, left to c10d's own keep-alive check.
KEEPALIVE_SLACK_S = 1.5
# The exit barrier's keys, in the round's own store (every node of a job runs ftrun's).
EXIT_KEY = "ftrun/exit"
# How often a node in the exit barrier looks whether the others finished or are lost.
EXIT_POLL_S = 0.5
# The states of a rank's resilient wrapper in which it can restart in place.
RESTARTABLE = ("running", "failed", "faulted", "aborted")


class InPlaceFailed(Exception):
    """An in-process restart could not finish; the message says why (the fallback's why)."""


class HostIsolated(_torch.rendezvous_keeping_error()):  # type: ignore[misc]
    """The coordinator isolated this node's host: its workers were stopped and its launcher
    must exit with ``ISOLATED`` while the rendezvous stays open for the other nodes.

    It derives from the error torch's launch path treats as a death signal: torch's agent
    then stops the workers with ``sigval`` (SIGKILL) and its ``launch_agent`` leaves the
    rendezvous open, as for a launcher stopped by a signal (see ftrun._torch).
    """

    def __init__(self, reason: str, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(f"host isolated by the coordinator: {reason}", signal.SIGKILL)
        self.reason = reason
        self.evidence = evidence or {}


class EventSink(Protocol):
    def event(self, type: str, **data: Any) -> None: ...


class _NoSink:
    def event(self, type: str, **data: Any) -> None:
        log.debug("event %s %s", type, data)


@dataclass
class AgentContext:
    """What the launcher hands its agent. Mutable: the agent registers itself here."""

    node_id: str
    host: str
    node_dir: Path  # private, host-local: progress files live here
    hang_timeout_s: float
    worker_env: dict[str, str] = field(default_factory=dict)
    # Warm workers (ftrun.launcher.warm): on, off or None (auto: by CPUs per local rank), and
    # the modules imported ahead besides torch.
    warm_workers: bool | None = None
    warm_imports: tuple[str, ...] = ()
    sink: EventSink = field(default_factory=_NoSink)
    agent: FtrunAgent | None = None
    store: StoreProcess | None = None
    # The coordinator's directives ({"id", "action", "data"}), put by the reporter's thread
    # and taken by the agent's; ``run_probe`` starts a probe directive on a thread of its own.
    directives: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    run_probe: Callable[[dict[str, Any]], None] | None = None
    # The first isolate directive, also kept apart from the queue: a signal handler reads it.
    isolate: dict[str, Any] | None = None

    def on_directive(self, directive: dict[str, Any]) -> None:
        """Queue a directive for the agent (thread-safe, never blocks). An ``isolate``
        arriving while the agent waits in a rendezvous interrupts that wait. A ``drop_node``
        is carried out at once on a thread of its own: the agent's thread may be waiting in
        the very rendezvous that waits for the lost node."""
        if directive.get("action") == "drop_node":
            if self.agent is not None:
                threading.Thread(target=self.agent.drop_lost_node, args=(directive,),
                                 name="ftrun-drop-node", daemon=True).start()
            else:
                log.info("directive %s: drop_node before this node's first rendezvous; "
                         "nothing to do", directive.get("id"))
            return
        if directive.get("action") == "isolate" and self.isolate is None:
            self.isolate = directive
        self.directives.put(directive)
        if directive.get("action") == "isolate" and self.agent is not None:
            self.agent.interrupt_rendezvous()


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
        sig = _signal_name(exitcode)
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


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class FtrunAgent(_torch.agent_class()):  # type: ignore[misc]
    """A LocalElasticAgent that reports to ftrun's coordinator and catches hung ranks."""

    def __init__(self, *, ctx: AgentContext, spec: WorkerSpec, **kwargs: Any) -> None:
        spec.entrypoint, spec.args = tie_entrypoint(spec.entrypoint, spec.args)
        super().__init__(spec=spec, **kwargs)
        self._ctx = ctx
        self._phase: NodeState = NodeState.INIT
        self._last_error: str | None = None
        self._exitcodes: dict[int, int] = {}
        self._rule = SuspectRule(hang_timeout_s=ctx.hang_timeout_s)
        self._watches: dict[int, RankWatch] = {}  # by local rank; new at every (re)start
        self._verdicts: dict[int, Verdict] = {}  # replaced whole by the agent thread
        # local rank -> (when to read, progress path, offset, rank, pid): stack dumps asked for
        self._stacks_due: dict[int, tuple[float, str, int, int, int]] = {}
        self._lock = threading.Lock()
        self._round: tuple[int, frozenset[str]] | None = None  # rendezvous round, members
        self._missing_since: dict[str, float] = {}
        # Rendezvous names of nodes the coordinator declared lost (drop_lost_node's thread
        # adds them): missing from this node's round, they are dropped without a grace.
        self._lost_nodes: set[str] = set()
        self._in_rendezvous = False
        self._isolated: HostIsolated | None = None
        # In-process restart: the generation of the ranks' world (one more per restart in
        # place), why the next restart is needed and when that was seen, and the
        # restart-in-place order of a coordinator's directive.
        try:
            self._inplace_timeout_s = max(0.0, float(knobs.INPLACE_TIMEOUT.get()))
        except ValueError:
            self._inplace_timeout_s = float(knobs.INPLACE_TIMEOUT.default)
        self._generation = 0
        self._restart_why: str | None = None
        # Why the last dead rank could not be replaced alone (torch's path took over).
        self._not_in_place: str | None = None
        self._detected_at: float | None = None
        self._inplace_request: str | None = None
        self._inplace_evidence_s = 0.0  # how old the coordinator's evidence was
        # Local ranks this launcher killed as hung: (why, its first evidence's wall time).
        self._hung_killed: dict[int, tuple[str, float]] = {}
        self._replace: set[int] = set()  # dead local ranks the next restart gives new processes
        # Every worker start (first, restart, replacement) tries a warm interpreter first.
        self._told_to_exit: set[int] = set()  # local ranks sent rank_exit (reset per start)
        warm = ctx.warm_workers
        if warm is None:
            warm = knobs.PARKED_WORKERS.enabled() or auto_warm(spec.local_world_size)
        self._warm = WarmPool.start_for(spec, ctx.worker_env, ctx.warm_imports, ctx.sink) \
            if warm else None
        # A node left on the wait list of a full round would restart every node, every round.
        _torch.spares_stay_spare(spec.rdzv_handler)
        ctx.agent = self

    # ---- what the heartbeat reports -------------------------------------------------
    def node_state(self) -> dict[str, Any]:
        wg = self.get_worker_group()
        spec = wg.spec
        pids = self.worker_pids()
        phase = self._phase
        verdicts = self._verdicts if phase is NodeState.HEALTHY else {}
        workers = []
        for w in wg.workers:
            workers.append({
                "local_rank": w.local_rank,
                "rank": w.global_rank,
                "pid": pids.get(w.local_rank),
                "state": phase.value if phase is not NodeState.HEALTHY else "running",
                "exitcode": self._exitcodes.get(w.local_rank),
                **verdicts.get(w.local_rank, NOT_WATCHED).fields(),
            })
        return {
            "state": phase.value,
            "group_rank": wg.group_rank,
            "group_world_size": wg.group_world_size,
            "restarts": spec.max_restarts - self.remaining_restarts(),
            "max_restarts": spec.max_restarts,
            "workers": workers,
            "last_error": self._last_error,
            # The coordinator names this node to the others by it when it is lost.
            "extra": {"rdzv_node": _torch.rendezvous_node(spec.rdzv_handler)},
        }

    def run(self, role: str = "default") -> RunResult:
        try:
            return super().run(role)
        finally:  # torch's shutdown runs at every restart too; the pool lives as long as this
            if self._warm is not None:
                self._warm.close()

    def forward_signal(self, sig: int) -> None:
        if self._ctx.store is not None:
            self._ctx.store.signal(sig)
        for local_rank, pid in self.worker_pids().items():
            try:
                os.kill(pid, sig)
                log.info("forwarded %s to local rank %d (pid %d)", signal.Signals(sig).name, local_rank, pid)
            except ProcessLookupError:
                pass

    # ---- torch's extension points ---------------------------------------------------
    def rendezvous(self, worker_group: WorkerGroup) -> None:
        self._phase = NodeState.RENDEZVOUS
        t0 = time.monotonic()
        self._in_rendezvous = True  # from here an isolate interrupts (interrupt_rendezvous)
        try:
            # An isolated host must not join a round: the others would restart to take it in.
            self._carry_out_directives(worker_group, running=False)
            super().rendezvous(worker_group)
        finally:
            self._in_rendezvous = False
        view = _torch.rendezvous_view(worker_group.spec.rdzv_handler)
        self._round = (view[0], view[1]) if view is not None else None
        self._missing_since = {}
        self._ctx.sink.event(
            "rendezvous",
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            ranks=[w.global_rank for w in worker_group.workers],
            duration_s=round(time.monotonic() - t0, 3),
        )

    def set_local_rank_env(
        self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec
    ) -> None:
        super().set_local_rank_env(worker_env, local_rank, spec)
        path = self._ctx.node_dir / f"progress-{local_rank}"
        create_progress_file(str(path))
        worker_env[knobs.PROGRESS_FILE.name] = str(path)
        if self._inplace_timeout_s > 0:
            worker_env[knobs.RANK_CONTROL.name] = self._control_base(local_rank)
            worker_env[knobs.RANK_GENERATION.name] = str(self._generation)
        # Where ranks report their collectives moves when the coordinator fails over (etcd):
        # a rank restarted in place takes the current one with its new world.
        worker_env[knobs.DETECT.name] = self._ctx.worker_env.get(knobs.DETECT.name, "")

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        os.environ.update(self._ctx.worker_env)
        for w in worker_group.workers:  # a new process registers anew
            base = self._control_base(w.local_rank)
            for path in (base + resilient.STATE_SUFFIX, base + resilient.SOCKET_SUFFIX):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self._replace = set()
        self._exitcodes.clear()
        self._watches = {w.local_rank: RankWatch(self._rule) for w in worker_group.workers}
        self._verdicts = {}
        self._told_to_exit = set()
        self._hung_killed = {}
        pids = super().start_workers(worker_group)
        self._phase = NodeState.HEALTHY
        self._ctx.sink.event(
            "workers_started",
            restart_count=worker_group.spec.max_restarts - self.remaining_restarts(),
            pids={str(k): v for k, v in pids.items()},
            ranks=[w.global_rank for w in worker_group.workers],
        )
        return pids

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._carry_out_directives(worker_group, running=True)
        if self._inplace_request is not None:
            self._note_restart(self._inplace_request, self._inplace_evidence_s)
            self._inplace_request = None
            return RunResult(state=WorkerState.UNHEALTHY)
        result = self._poll_workers(worker_group)
        if result.state == WorkerState.UNHEALTHY and self._replace:
            return result
        store = self._ctx.store
        if store is not None:
            code = store.check()
            if code is not None:
                self._ctx.sink.event("store_restarted", exitcode=code, pid=store.pid,
                                     restarts=store.restarts)
        if result.state == WorkerState.HEALTHY:
            dropped = self._dropped_members(worker_group)
            if dropped:
                return self._on_dropped(worker_group, dropped)
            # A hung rank is killed here; the next tick sees it die like any crashed worker,
            # so torch's own failure path (restart or failure summary) takes it from there.
            self._watch_workers(worker_group)
        elif result.state == WorkerState.FAILED:
            self._report_failures(worker_group, result)
        elif result.state == WorkerState.SUCCEEDED:
            self._phase = NodeState.SUCCEEDED
        return result

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

    # ---- in-process restart -----------------------------------------------------------
    _rendezvous_done_for_fallback = False

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
            self._note_restart(f"rank {by_local[lr]} lost a peer: {note}"[:300])
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
        sig = _signal_name(code)
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
                             timestamp=time.time(), in_place=True)
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
        self.rendezvous(worker_group)  # new ranks, world size, master address and port
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
            stopped_killed=sorted(by_local[lr] for lr in stopped),
            detect_s=round(t0 - detected, 3), abort_s=round(t_abort - t0, 3),
            rendezvous_s=round(t_rdzv - t_abort, 3), world_s=round(t_world - t_rdzv, 3),
            total_s=round(t_world - detected, 3))
        log.warning("workers restarted in place (generation %d, %.3f s: abort %.3f s, "
                    "rendezvous %.3f s, world %.3f s; new processes for rank(s) %s): %s", gen,
                    t_world - detected, t_abort - t0, t_rdzv - t_abort, t_world - t_rdzv,
                    sorted(by_local[lr] for lr in dead) or "none", why)

    def _start_new(self, worker_group: WorkerGroup) -> None:
        """New processes for a group whose rendezvous is done (torch's
        ``_initialize_workers`` after its rendezvous)."""
        pids = self.start_workers(worker_group)
        for local_rank, pid in pids.items():
            worker_group.workers[local_rank].id = pid
        worker_group.state = WorkerState.HEALTHY

    def shutdown(self, death_sig: signal.Signals, timeout: int) -> None:
        # A stopped process never handles SIGTERM until continued, so torch would wait the
        # full timeout for it. It cannot clean up anyway: kill it now.
        for local_rank, pid in self.worker_pids().items():
            if proc_state(pid) in ("T", "t"):
                log.warning("local rank %d (pid %d) is stopped; killing it", local_rank, pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        super().shutdown(death_sig, timeout)

    def exit_barrier(self) -> None:
        """torch's exit barrier (each node waits, up to its exit-barrier timeout, until
        every node of the round has finished, so that the rendezvous store outlives them),
        except that a node the coordinator declared lost and a survivor took out of the
        rendezvous (:meth:`drop_lost_node`) is not waited for: a host that dies after its
        workers finished kept the others idle for the whole timeout (300 s by default).
        The wait looks every :data:`EXIT_POLL_S` instead of one blocking ``wait`` on the
        store client that the keep-alives and the drop share (they would queue behind it)."""
        store, world = self.rendezvous_store(), self.get_worker_group().group_world_size
        me = _torch.rendezvous_node(self.get_worker_group().spec.rdzv_handler) or "?"
        members = self._round[1] if self._round is not None else frozenset()
        timeout_s = self.exit_barrier_timeout()
        log.info("workers finished; waiting up to %.0f s for the other nodes of the round to "
                 "finish (not for a node declared lost)", timeout_s)
        self.mark_exit_barrier(True)
        started = time.monotonic()
        try:
            store.set(f"{EXIT_KEY}/done/{me}", "1")
            if store.add(f"{EXIT_KEY}/count", 1) >= world:
                store.set(f"{EXIT_KEY}/all", "1")
            while not store.check([f"{EXIT_KEY}/all"]):
                # A lost node that finished before it was lost is counted already.
                lost = sorted(n for n in members & self._lost_nodes
                              if not store.check([f"{EXIT_KEY}/done/{n}"]))
                finished = int(store.get(f"{EXIT_KEY}/count")) if lost else 0
                if lost and finished + len(lost) >= world:
                    log.warning("every node of the round finished but %s, which the "
                                "coordinator declared lost: not waiting for it",
                                ", ".join(lost))
                    self._ctx.sink.event("exit_barrier_left", lost=lost, finished=finished,
                                         nodes=world)
                    return
                if time.monotonic() - started >= timeout_s:
                    finished = int(store.get(f"{EXIT_KEY}/count"))
                    log.warning("exit barrier: %d of %d nodes finished within %.0f s "
                                "(torch's exit-barrier timeout); exiting without the others",
                                finished, world, timeout_s)
                    return
                time.sleep(EXIT_POLL_S)
            log.info("every node finished (%.1f s in the exit barrier)",
                     time.monotonic() - started)
        except (RuntimeError, OSError) as e:  # the store's host is gone: nothing to keep
            log.warning("exit barrier: the rendezvous store failed (%s: %s); exiting",
                        type(e).__name__, e)
        finally:
            self.mark_exit_barrier(False)

    # ---- the coordinator's directives -------------------------------------------------
    @property
    def in_rendezvous(self) -> bool:
        """Whether the agent's thread is in (or about to enter) a rendezvous wait."""
        return self._in_rendezvous

    def interrupt_rendezvous(self) -> None:
        """Called from the reporter's thread when an ``isolate`` arrives: a rendezvous wait
        can last minutes, so the agent's thread is interrupted with SIGUSR2 (its handler,
        :meth:`on_interrupt`, raises there); at any other time the next monitor tick acts."""
        if self._in_rendezvous:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR2)

    def on_interrupt(self) -> None:
        """SIGUSR2's handler on the agent's (main) thread: leave the rendezvous wait for a
        pending ``isolate``; nothing otherwise. It touches no lock the interrupted code may
        hold (the directive queue's included): the directive is read from ``ctx.isolate``."""
        directive = self._ctx.isolate
        if self._in_rendezvous and directive is not None and self._isolated is None:
            self._in_rendezvous = False
            log.warning("an isolate directive interrupts this node's rendezvous wait")
            self._isolate_by(directive)

    def _carry_out_directives(self, worker_group: WorkerGroup | None, running: bool) -> None:
        """Take every queued directive and act on it, on the agent's thread. Raises
        :class:`HostIsolated` for an ``isolate``."""
        while True:
            try:
                directive = self._ctx.directives.get_nowait()
            except queue.Empty:
                return
            action = directive.get("action")
            data = directive.get("data") or {}
            did = directive.get("id")
            if action == "isolate":
                self._isolate_by(directive, worker_group)
            elif action == "restart":
                world = data.get("world")
                ours = (f"{worker_group.master_addr}:{worker_group.master_port}"
                        if worker_group is not None else None)
                if running and worker_group is not None and world and world != ours:
                    log.info("directive %s: restart of ranks %s decided in world %s; the "
                             "workers run in world %s now: dropped", did, data.get("ranks"),
                             world, ours)
                    self._ctx.sink.event("directive_dropped", id=did, world=world, ours=ours,
                                         reason=str(data.get("reason") or ""))
                elif running and worker_group is not None:
                    self._kill_ranks(worker_group, data.get("ranks") or [],
                                     str(data.get("reason") or "no reason given"), did, data)
                else:
                    log.info("directive %s: restart of ranks %s while no workers run; nothing "
                             "to kill", did, data.get("ranks"))
            elif action == "probe":
                if self._ctx.run_probe is None:
                    log.warning("directive %s: probe, but this launcher has no probe service",
                                did)
                else:
                    self._ctx.run_probe(directive)
            else:
                log.warning("directive %s: unknown action %r ignored (a newer coordinator?)",
                            did, action)

    def drop_lost_node(self, directive: dict[str, Any]) -> None:
        """Carry out a ``drop_node`` directive (on a thread of its own): take the node the
        coordinator declared lost out of the rendezvous state, so that this node's
        rendezvous (or, while its workers train, its check for dropped members) goes on
        without it now rather than when its c10d keep-alives expire. Never this node
        itself, and not a node whose keep-alive reached the rendezvous after its launcher
        went silent (:data:`KEEPALIVE_SLACK_S`)."""
        data = directive.get("data") or {}
        node, rdzv_node = str(data.get("node") or "?"), str(data.get("rdzv_node") or "")
        reason = str(data.get("reason") or "declared lost by the coordinator")
        handler = self.get_worker_group().spec.rdzv_handler
        if not rdzv_node or rdzv_node == _torch.rendezvous_node(handler):
            log.warning("directive %s: drop_node names %s; not another node's rendezvous "
                        "name: ignored", directive.get("id"), rdzv_node or "nothing")
            return
        try:
            silent_s = float(data.get("silent_s") or 0.0)
            outcome, round_, age_s = _torch.drop_rendezvous_node(
                handler, rdzv_node, max(0.0, silent_s - KEEPALIVE_SLACK_S), DROP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the keep-alive expiry still drops it
            log.warning("could not drop lost node %s from the rendezvous (%s: %s); it is "
                        "dropped when its keep-alives expire", node, type(e).__name__, e)
            return
        age = "none" if age_s is None else f"{age_s:.1f} s ago"
        if outcome in ("dropped", "absent"):
            self._lost_nodes.add(rdzv_node)  # no grace in _dropped_members: it is lost
        if outcome == "dropped":
            log.warning("lost node %s (%s) dropped from rendezvous round %s before its "
                        "keep-alives expired (its last keep-alive: %s): %s", node, rdzv_node,
                        round_, age, reason)
            self._ctx.sink.event("rendezvous_node_dropped", lost_node=node, rdzv_node=rdzv_node,
                                 round=round_, reason=reason, early=True,
                                 keepalive_age_s=None if age_s is None else round(age_s, 3))
        elif outcome == "alive":
            log.warning("node %s was declared lost (%s), but its keep-alive reached the "
                        "rendezvous %s, after its launcher went silent: not dropped; "
                        "c10d's keep-alive check decides", node, reason, age)
            self._ctx.sink.event("rendezvous_drop_refused", lost_node=node, rdzv_node=rdzv_node,
                                 keepalive_age_s=None if age_s is None else round(age_s, 3),
                                 reason=reason)
        else:
            log.info("lost node %s: %s in the rendezvous state (round %s)", node, outcome,
                     round_)

    def _kill_ranks(self, worker_group: WorkerGroup, ranks: list[Any], reason: str,
                    did: Any, directive_data: dict[str, Any] | None = None) -> None:
        pids = self.worker_pids()
        wanted = {r for r in ranks if isinstance(r, int)}
        mine = [w.global_rank for w in worker_group.workers if w.global_rank in wanted]
        if mine and self.remaining_restarts() > 0 and \
                self._cannot_restart_in_place(worker_group) is None:
            # Every local rank can restart in place: abort them all rather than kill the
            # culprits (a stopped one is killed at once, one stuck inside a C call after
            # FTRUN_INPLACE_TIMEOUT: _restart_in_place).
            log.error("rank(s) %s named by the coordinator: %s; restarting the workers in "
                      "place", mine, reason)
            self._last_error = f"rank(s) {', '.join(map(str, mine))} restarted: {reason}"[:1024]
            self._inplace_request = f"coordinator: rank(s) {mine}: {reason}"[:300]
            age = (directive_data or {}).get("evidence_age_s")
            self._inplace_evidence_s = float(age) if isinstance(age, (int, float)) \
                and 0 <= age < 86400 else 0.0
            self._ctx.sink.event("directive_restart", id=did, ranks=sorted(wanted), killed=[],
                                 in_place=True, reason=reason)
            return
        killed = []
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if w.global_rank not in wanted or pid is None:
                continue
            log.error("rank %d (local %d, pid %d) killed by the coordinator: %s; the workers "
                      "restart", w.global_rank, w.local_rank, pid, reason)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(w.global_rank)
        if killed:
            self._last_error = f"rank(s) {', '.join(map(str, killed))} killed: {reason}"[:1024]
        self._ctx.sink.event("directive_restart", id=did, ranks=sorted(wanted), killed=killed,
                             reason=reason)

    def _leave_round(self, worker_group: WorkerGroup) -> None:
        """Leave the rendezvous round (not the rendezvous): the others re-rendezvous without
        this node at once, rather than once its keep-alives expire."""
        handler = worker_group.spec.rdzv_handler
        if _torch.leave_rendezvous(handler, LEAVE_TIMEOUT_S):
            log.info("left rendezvous round %s", self._round[0] if self._round else "?")

    def _isolate_by(self, directive: dict[str, Any],
                    worker_group: WorkerGroup | None = None) -> None:
        data = directive.get("data") or {}
        evidence = data.get("evidence")
        self._isolate(str(data.get("reason") or "no reason given"),
                      evidence if isinstance(evidence, dict) else {}, directive.get("id"),
                      worker_group)

    def _isolate(self, reason: str, evidence: dict[str, Any], did: Any,
                 worker_group: WorkerGroup | None) -> None:
        """Kill every worker, leave the rendezvous round (when not inside a rendezvous
        operation already), record why, and raise HostIsolated."""
        self._in_rendezvous = False  # no second isolate may interrupt this one
        pids = self.worker_pids()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)  # stopped or hung ones too, all at once
            except ProcessLookupError:
                pass
        log.error("this host (%s) was isolated by the coordinator: %s. Its %d worker(s) were "
                  "killed and this launcher leaves the job; the other nodes continue without "
                  "it", self._ctx.host, reason, len(pids))
        if worker_group is not None:
            self._leave_round(worker_group)
        self._last_error = f"host isolated: {reason}"[:1024]
        self._phase = NodeState.FAILED
        self._ctx.sink.event("node_isolated", id=did, host=self._ctx.host, reason=reason,
                             evidence=evidence, killed=sorted(pids.values()))
        self._isolated = HostIsolated(reason, evidence)
        raise self._isolated

    # ---- ftrun's checks ---------------------------------------------------------------
    def _dropped_members(self, worker_group: WorkerGroup) -> list[str]:
        """Members of this node's round that the rendezvous dropped (this node included)."""
        if self._round is None:
            return []
        view = _torch.rendezvous_view(worker_group.spec.rdzv_handler)
        if view is None or view[0] != self._round[0]:
            return []  # a new round: torch's own path brings this node into it
        now = time.monotonic()
        gone = self._round[1] - view[2]
        self._missing_since = {n: self._missing_since.get(n, now) for n in gone}
        return sorted(n for n, t in self._missing_since.items()
                      if now - t >= DROPPED_GRACE_S or n in self._lost_nodes)

    def _on_dropped(self, worker_group: WorkerGroup, dropped: list[str]) -> RunResult:
        """Restart this node's workers (torch's failure path: a restart is counted)."""
        me = _torch.rendezvous_node(worker_group.spec.rdzv_handler)
        if me in dropped:
            log.error("this node was dropped from rendezvous round %d (its keep-alives did not "
                      "reach the rendezvous store): stopping its workers to rejoin the job",
                      self._round[0] if self._round else -1)
            reason = "this node was dropped from the rendezvous"
        else:
            log.error("node(s) %s dropped out of rendezvous round %d (no keep-alive within the "
                      "c10d timeout; host dead or unreachable): restarting the workers without "
                      "them", ", ".join(dropped), self._round[0] if self._round else -1)
            reason = f"node(s) {', '.join(dropped)} dropped from the rendezvous"
        self._last_error = reason
        self._ctx.sink.event("node_dropped", nodes=dropped, self_dropped=me in dropped,
                             round=self._round[0] if self._round else None)
        self._round = None  # once per round
        return RunResult(state=WorkerState.UNHEALTHY)

    def _report_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        by_global = {w.global_rank: w for w in worker_group.workers}
        first: tuple[float, str] | None = None
        for rank, failure in result.failures.items():
            worker = by_global.get(rank)
            local_rank = worker.local_rank if worker else failure.local_rank
            self._exitcodes[local_rank] = failure.exitcode
            message = failure.message if isinstance(failure.message, str) else str(failure.message)
            sig = _signal_name(failure.exitcode)
            summary = f"rank {rank} exited with {sig or f'code {failure.exitcode}'}"
            if failure.error_file_data:
                summary += f": {message}"
            if first is None or failure.timestamp < first[0]:
                first = (failure.timestamp, summary)
            self._ctx.sink.event(
                "worker_failure",
                rank=rank,
                local_rank=local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=sig,
                message=message[:4096],
                timestamp=failure.timestamp,
            )
        if first is not None:
            self._last_error = first[1][:1024]
            # torch's failure record carries the first failure's time (its error file's, or
            # when torch saw the exit): the first evidence, for recovery.detect_s.
            age = time.time() - first[0] if first[0] else 0.0
            self._note_restart(first[1][:300], age if 0 <= age < 3600 else 0.0)
        self._phase = NodeState.FAILED if self.remaining_restarts() == 0 else NodeState.RESTARTING

    def _watch_workers(self, worker_group: WorkerGroup) -> None:
        """Judge every running rank (suspect or not) and kill the hung ones."""
        timeout_s = self._ctx.hang_timeout_s
        stopped_limit_s = max(1.0, timeout_s / 3) if timeout_s > 0 else STOPPED_LIMIT_S
        now_ns = time.monotonic_ns()
        self._log_stacks(now_ns / 1e9)
        pids = self.worker_pids()
        verdicts: dict[int, Verdict] = {}
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if pid is None:
                continue
            path = str(self._ctx.node_dir / f"progress-{w.local_rank}")
            state = proc_state(pid)
            p = read_progress(path)
            watch = self._watches.setdefault(w.local_rank, RankWatch(self._rule))
            verdict = watch.observe(p, state, now_ns)
            self._note_verdict(w.global_rank, w.local_rank, pid, verdict, p, path)
            verdicts[w.local_rank] = verdict
            reason = None
            if verdict.stopped_s is not None:
                # A stopped rank is certainly the culprit, while ranks waiting for it in a
                # collective merely stall: catch it well before their stall looks like a hang.
                if verdict.stopped_s >= stopped_limit_s:
                    reason = f"stopped (SIGSTOP) for {verdict.stopped_s:.1f} s"
            elif (timeout_s > 0 and p is not None and p.reported and not p.done
                    and p.age_s() >= timeout_s):
                waited = p.collective_wait_s(now_ns)
                if waited is not None and waited < VICTIM_FACTOR * timeout_s:
                    # Blocked in a collective: it waits for a peer (the culprit, which
                    # stopped outside any collective, here or on another node, is killed
                    # and the restart releases this one). Only a wait that outlasts the
                    # culprit's limit too (a hang inside the collective) is its own.
                    continue
                reason = f"no progress for {p.age_s():.1f} s after step {p.step}"
                if waited is not None:
                    reason += f", blocked in a collective for {waited:.1f} s"
                create_progress_file(path)
            if reason is None:
                continue
            log.error(
                "rank %d (local %d, pid %d) is hung: %s (--hang-timeout %.1f s); "
                "killing it and restarting the workers",
                w.global_rank, w.local_rank, pid, reason, timeout_s,
            )
            self._last_error = f"rank {w.global_rank} hung: {reason}"
            age = p.age_s(now_ns) if p is not None and p.reported else 0.0
            self._hung_killed[w.local_rank] = (reason, time.time() - age)
            self._ctx.sink.event(
                "hang_detected", rank=w.global_rank, local_rank=w.local_rank, pid=pid,
                reason=reason, hang_timeout_s=timeout_s,
            )
            self._log_stacks(math.inf)  # whatever the dump holds, before the process goes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._verdicts = verdicts

    def _log_stacks(self, now: float) -> None:
        """Log, as one block each, the stack dumps asked for at least STACKS_WAIT_S ago."""
        for local_rank, (due, path, offset, rank, pid) in list(self._stacks_due.items()):
            if now < due:
                continue
            del self._stacks_due[local_rank]
            text = read_stacks(path, offset).rstrip()
            if text:
                log.warning("rank %d (local %d, pid %d): its threads' Python stacks:\n%s", rank,
                            local_rank, pid, text)
            else:
                log.warning("rank %d (local %d, pid %d) wrote no stacks (its process may be "
                            "stuck in a system call that blocks signals)", rank, local_rank, pid)

    def _note_verdict(self, rank: int, local_rank: int, pid: int, verdict: Verdict,
                      progress: Progress | None = None, path: str = "") -> None:
        """Log and record a rank turning suspect, changing cause, or recovering. A rank that
        stopped progressing writes its threads' stacks, logged a moment later: where it
        hangs."""
        before = self._verdicts.get(local_rank, NOT_WATCHED)
        if verdict.cause == before.cause:
            return
        if verdict.suspect:
            offset = (request_stacks(pid, path, progress)
                      if verdict.cause is SuspectCause.NO_PROGRESS and path else None)
            if offset is not None:
                self._stacks_due[local_rank] = (time.monotonic() + STACKS_WAIT_S, path, offset,
                                                rank, pid)
            log.warning("rank %d (local %d, pid %d) is suspect: %s%s", rank, local_rank, pid,
                        verdict.reason,
                        "; its threads' Python stacks follow" if offset is not None else "")
            self._ctx.sink.event(
                "rank_suspect", rank=rank, local_rank=local_rank, pid=pid,
                cause=str(verdict.cause), reason=verdict.reason, step=verdict.step,
                progress_age_s=verdict.fields()["progress_age_s"],
                progress_limit_s=verdict.fields()["progress_limit_s"],
            )
        else:
            log.info("rank %d (local %d, pid %d) is no longer suspect (was: %s)", rank,
                     local_rank, pid, before.reason)
            self._ctx.sink.event("rank_cleared", rank=rank, local_rank=local_rank, pid=pid,
                                 cause=str(before.cause), step=verdict.step)
