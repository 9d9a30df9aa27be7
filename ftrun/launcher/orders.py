"""The coordinator's directives and lost members, the agent's part (a mixin of
:class:`ftrun.launcher.agent.FtrunAgent`): ``restart`` (in place, or the named ranks
killed), ``isolate`` (:class:`HostIsolated`), ``probe``, ``drop_node`` (a lost node taken out
of the rendezvous), and members the rendezvous dropped for missed keep-alives."""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerState,
)

from ftrun import _torch
from ftrun.coordinator.api import NodeState

log = logging.getLogger("ftrun.launcher.agent")

# A member of the round missing from the rendezvous state for this long was dropped for
# missed keep-alives: a node that restarts leaves the round and enters the wait list in
# consecutive syncs, well within it.
DROPPED_GRACE_S = 2.0
# How long an isolated node tries to leave its rendezvous round before it exits anyway.
LEAVE_TIMEOUT_S = 5.0
# How long a survivor tries to take a lost node out of the rendezvous state.
DROP_TIMEOUT_S = 5.0
# A lost node's c10d keep-alive may be this much younger than the silence the coordinator
# measured (its last heartbeat may precede its last keep-alive by an interval; clocks differ
# a little) and the node still count as lost; a younger one reached the rendezvous after its
# launcher went silent to the coordinator: not lost, left to c10d's own keep-alive check.
KEEPALIVE_SLACK_S = 1.5


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


class Orders:
    """Directives and isolation: a mixin over the agent's state."""

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
