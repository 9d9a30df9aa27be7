"""A new world for the same members, decided without a rendezvous round.

When an in-process restart keeps the membership (a rank failed, no node was lost, none waits
to join), every node of the round restarts with the ranks it had: torch's rendezvous round,
whose nodes poll its shared state for one another (a second at a time, seconds in all), only
renews what the nodes already agree on. Instead each restarting node casts a vote in the
round's own store (the rendezvous store every node already holds):

- ``keep`` (it may re-form as it is) adds one to a counter; the node whose addition brings the
  counter to the number of nodes writes the decision ``keep`` (compare-and-set: the first
  decision written stands);
- ``round`` (a node waits to join, a member left the round, this node cannot restart in place)
  writes the decision ``round`` at once;
- every node then waits on the decision key (the store answers as soon as it is written: a
  push, not a poll). A node that has waited past its deadline, or sees a member gone meanwhile,
  writes ``round``; if ``keep`` was written first it reads ``keep`` back and follows it.

Every node therefore follows the same decision. On ``keep`` the group's rank-0 node has put a
free port for the new world's master in the store before its vote; ranks, world size and the
master's host stay. On ``round`` everyone goes through torch's rendezvous, whose new round (and
its store) starts the counting over. A node that does not vote (it restarts through torch's
path) stops the others at their deadline, and its join into the next round makes them
restart too.

Per node and decision: one addition, at most two compare-and-sets and one blocking wait at
the store, whatever the number of nodes."""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrun import _torch, knobs
from ftrun.coordinator.api import NodeState

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

log = logging.getLogger("ftrun.launcher.agent")

KEEP, ROUND = "keep", "round"
# How often a waiting node looks at whether it should stop waiting (``give_up``).
CHECK_EVERY_S = 0.5


@dataclass(frozen=True)
class Decision:
    verdict: str  # KEEP or ROUND
    why: str  # why ROUND (empty for KEEP)
    master_port: int | None  # the new world's master port (KEEP)
    waited_s: float


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Reform:
    """The votes of one re-formation, under ``prefix`` of a round's ``store`` (a c10d store:
    ``add``, ``compare_set``, ``wait``, ``get``) among ``nodes`` nodes."""

    def __init__(self, store: Any, prefix: str, nodes: int) -> None:
        self._store = store
        self._prefix = prefix
        self._nodes = nodes

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _decide(self, verdict: str, why: str) -> tuple[str, str]:
        """Write ``verdict`` unless a decision is there; returns the one that stands."""
        desired = f"{verdict}:{why}"
        got = _text(self._store.compare_set(self._key("decision"), "", desired))
        verdict, _, why = got.partition(":")
        return verdict, why

    def veto(self, why: str) -> None:
        """Decide ``round`` (this node goes through torch's rendezvous)."""
        self._decide(ROUND, why)

    def vote(self, keep: bool, why: str, master_port: int | None, deadline_s: float,
             give_up: Callable[[], str | None]) -> Decision:
        """Vote (``keep``, or ``round`` because of ``why``) and wait for the decision, at
        most ``deadline_s``; ``give_up`` (asked every CHECK_EVERY_S) names a reason to stop
        waiting (a member gone). ``master_port``: this node hosts the new world's master
        (the group's rank 0) and offers this port."""
        t0 = time.monotonic()
        if not keep:
            verdict, reason = self._decide(ROUND, why)
        else:
            if master_port is not None:
                self._store.set(self._key("master_port"), str(master_port))
            if int(self._store.add(self._key("keep"), 1)) >= self._nodes:
                self._decide(KEEP, "")
            verdict, reason = self._wait(t0 + deadline_s, give_up)
        port = None  # (none offered: the master keeps its port)
        if verdict == KEEP and self._store.check([self._key("master_port")]):
            port = int(_text(self._store.get(self._key("master_port"))))
        return Decision(verdict, reason, port, time.monotonic() - t0)

    def _wait(self, deadline: float, give_up: Callable[[], str | None]) -> tuple[str, str]:
        key = self._key("decision")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self._decide(ROUND, "not every node voted in time")
            with contextlib.suppress(Exception):  # the store's timeout: not decided yet
                self._store.wait([key], datetime.timedelta(seconds=min(CHECK_EVERY_S, left)))
                verdict, _, why = _text(self._store.get(key)).partition(":")
                return verdict, why
            why = give_up()
            if why is not None:
                return self._decide(ROUND, why)


class NewWorlds:
    """The agent's part (a mixin of :class:`ftrun.launcher.agent.FtrunAgent`, over its
    ``_round``, ``_ctx``, ``_phase`` and torch's ``rendezvous``): the world a restart in place
    goes on in, pushed from votes when the members stay."""

    # (round, re-formations without a new round in it so far): names the next one's votes.
    _reforms: tuple[int, int] = (-1, 0)

    def _reform_votes(self, worker_group: WorkerGroup) -> Reform | None:
        """The votes of this node's next re-formation in the current round (None: no round
        store to vote in: no round yet, or not c10d's: a pushed world needs its store's
        compare-and-set and blocking wait)."""
        if (self._round is None or worker_group.store is None
                or worker_group.spec.rdzv_handler.get_backend() != "c10d"):
            return None
        return Reform(worker_group.store, f"ftrun/reform/{self._reform_count()}",
                      worker_group.group_world_size)

    def _reform_count(self) -> int:
        """Re-formations without a new round so far in this node's current round."""
        same = self._round is not None and self._reforms[0] == self._round[0]
        return self._reforms[1] if same else 0

    def _keeps_members(self, worker_group: WorkerGroup) -> str | None:
        """Why this node cannot re-form with the same members now (None: it can)."""
        if not knobs.PUSHED_WORLD.enabled():
            return "FTRUN_PUSHED_WORLD=0"
        return self._members_gone(worker_group)

    def _members_gone(self, worker_group: WorkerGroup) -> str | None:
        """Why the members of this node's round have changed (None: they have not), read
        afresh from the rendezvous state (one sync: torch drops members whose keep-alives
        expired, the coordinator has lost ones dropped)."""
        handler = worker_group.spec.rdzv_handler
        if handler.num_nodes_waiting() > 0:  # (refreshes the view read below)
            return "a node waits to join"
        view = _torch.rendezvous_view(handler)
        assert self._round is not None
        if view is None or view[0] != self._round[0]:
            return "a new rendezvous round began"
        gone = self._round[1] - view[1]
        if gone:
            return f"node(s) {sorted(gone)} left the round"
        return None

    def _new_world(self, worker_group: WorkerGroup) -> str:
        """The restarted world's ranks and master (``"pushed"``: the same members re-formed
        from votes in the round's store; ``"rendezvous"``: torch's round, as every node does
        when any one cannot keep the members)."""
        votes = self._reform_votes(worker_group)
        if votes is None:
            self.rendezvous(worker_group)
            return "rendezvous"
        self._phase = NodeState.RENDEZVOUS
        try:
            why = self._keeps_members(worker_group)
        except Exception as e:  # the rendezvous state unreadable: torch's round says more
            why = f"the rendezvous state could not be read ({e})"
        spec = worker_group.spec
        # The master's port: the user's (--master-port), the agent's own store when the
        # ranks share it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0), else a new one.
        fixed = bool(spec.master_port) or bool(getattr(spec.rdzv_handler, "use_agent_store",
                                                       False))
        port = None
        if why is None and worker_group.group_rank == 0 and not fixed:
            port = _torch.free_port_any_address()  # as the first round's (see _torch)
        try:
            decision = votes.vote(why is None, why or "", port, self._inplace_timeout_s,
                                  lambda: self._members_gone(worker_group))
        except Exception as e:  # the round's store unreachable: torch's round says more
            log.warning("re-forming the same members failed (%s): new rendezvous round", e)
            self.rendezvous(worker_group)
            return "rendezvous"
        if decision.verdict != KEEP:
            log.info("the world re-forms through a new rendezvous round: %s (after %.3f s)",
                     decision.why, decision.waited_s)
            self.rendezvous(worker_group)
            return "rendezvous"
        assert self._round is not None
        self._reforms = (self._round[0], self._reform_count() + 1)
        if not fixed and decision.master_port is not None:
            worker_group.master_port = decision.master_port
        self._ctx.sink.event(
            "rendezvous", group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            ranks=[w.global_rank for w in worker_group.workers],
            duration_s=round(decision.waited_s, 3), pushed=True)
        return "pushed"
