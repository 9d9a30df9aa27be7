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

The class is the agent's life cycle (start, monitor tick, shutdown, the heartbeat's state);
its parts live with their concerns as mixins: :mod:`ftrun.launcher.inplace` (in-process
restart and dead ranks), :mod:`ftrun.launcher.orders` (directives, isolation, lost members),
:mod:`ftrun.launcher.watch` (hangs, verdicts, stack dumps, failure reports) and
:mod:`ftrun.launcher.exit_barrier`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
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
from ftrun.coordinator.api import NodeState
from ftrun.launcher.exit_barrier import ExitBarrier
from ftrun.launcher.inplace import InPlaceRestarts, proc_state
from ftrun.launcher.orders import HostIsolated, Orders
from ftrun.launcher.reform import NewWorlds
from ftrun.launcher.store_proc import StoreProcess
from ftrun.launcher.suspect import NOT_WATCHED, RankWatch, SuspectRule, Verdict
from ftrun.launcher.warm import WarmPool, auto_warm
from ftrun.launcher.watch import WorkerWatch
from ftrun.pdeath import tie_entrypoint
from ftrun.rank import resilient
from ftrun.rank.progress import create_progress_file

log = logging.getLogger(__name__)

__all__ = ["AgentContext", "FtrunAgent", "HostIsolated"]


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


class FtrunAgent(InPlaceRestarts, NewWorlds, Orders, WorkerWatch, ExitBarrier,
                 _torch.agent_class()):  # type: ignore[misc]
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
        # Rank 0's store must be able to listen on the port the round picks for it.
        _torch.master_port_free_on_every_address()
        # A re-formation's nodes wait for each other: they poll sooner than torch's second.
        nodes = _torch.rendezvous_max_nodes(spec.rdzv_handler)
        if nodes is not None:
            _torch.quick_rendezvous_polls(nodes)
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
            # Nodes voting to re-form the same members stop waiting for this one.
            votes = self._reform_votes(worker_group)
            if votes is not None:
                with contextlib.suppress(Exception):
                    votes.veto("a node joins a new rendezvous round")
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


    # ---- in-process restart -----------------------------------------------------------


















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
















