"""Reports aggregated on the way: which launcher reports through which, decided by the
coordinator.

At thousands of nodes the coordinator's work is one message per launcher per heartbeat
interval. Aggregation cuts it to one per *group*: the launchers of a job are cut into groups of
``group_size`` by their node rank (``group_rank // group_size``), one launcher of each group
(its *aggregator*) takes its members' heartbeats and keep-alives, and sends them on together in
one signed ``aggregate`` message per interval. The coordinator's reply carries each member's
directives, which the aggregator hands on in its reply to the member's next report. Hello,
events and bye still go straight to the coordinator (they are rare), and so does everything
while a launcher has no plan.

**Small jobs are unchanged.** Aggregation starts only when more launchers have a node rank
than one group holds (there are two groups at least); up to that, and with a group size of 0
or 1 (``FTRUN_AGGREGATE_GROUP``), every launcher reports directly as before. A group of one
reports directly too.

**Plans.** What one launcher is told is a :class:`Plan`: report directly (``via`` empty),
aggregate your group (``via`` is the launcher itself), or report through ``via`` at ``addr``.
Each plan has a number (unique, also across the coordinator's restarts); a launcher names the plan it
follows in every heartbeat and keep-alive (``plan``), and the coordinator sends the plan
again (an ``aggregate`` directive, never acked) in its reply to any report naming another.
An aggregator is named first and its members are pointed at it only once it reports where it
listens (``aggr_addr`` in its heartbeat).

**Who aggregates.** The member with the lowest node rank, but not on the coordinator's own
host when another member is elsewhere (that host is the busiest of the job already, and
losing it loses the coordinator too): deterministic, the same table gives the same choice.

**Handover.** The aggregator of a group stays while it is live and in the group; when it is
lost or leaves, or its node rank moves it out of the group, the next by the same rule takes
the role. Members do not
wait for that: a member whose aggregator stops answering falls back to reporting directly
(:class:`ftrun.coordinator.client.NodeReporter`), so the coordinator keeps hearing from it.
How a member's silence is judged while its aggregator is the one silent is
:mod:`ftrun.coordinator.membership`'s part.

Thread-safety: the coordinator's serving thread is the only caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ftrun.coordinator.api import Action
from ftrun.coordinator.membership import NodeRecord
from ftrun.knobs import whole_number

DEFAULT_GROUP_SIZE = 16


@dataclass(frozen=True)
class Plan:
    """Whom one launcher reports through: ``via`` "" (directly), itself (it aggregates its
    group), or another launcher listening at ``addr``. ``number`` is unique per plan given."""

    number: int
    via: str
    addr: str
    group: int

    def directive(self) -> dict[str, Any]:
        """The ``aggregate`` directive that tells a launcher this plan."""
        return {"id": f"plan-{self.number}", "action": Action.AGGREGATE.value,
                "data": {"plan": self.number, "via": self.via, "addr": self.addr,
                         "group": self.group}}


def parse_group_size(text: str, source: str) -> int:
    """The group size from ``text`` (``FTRUN_AGGREGATE_GROUP`` or a flag); ConfigError-like
    ValueError naming ``source`` when it is not a whole number >= 0."""
    size = whole_number(text)
    if size is None:
        raise ValueError(f"{source}={text!r} is not a group size: give a whole number of "
                         "launchers per aggregation group (0 or 1: every launcher reports "
                         f"directly; default {DEFAULT_GROUP_SIZE})")
    return size


class Groups:
    """The coordinator's aggregation plan: groups, their aggregators, each launcher's plan."""

    def __init__(self, group_size: int, coordinator_host: str = "") -> None:
        self.group_size = group_size
        self.coordinator_host = coordinator_host
        self._plans: dict[str, Plan] = {}  # node -> its plan (absent: direct, never told)
        self._aggregators: dict[int, str] = {}  # group -> its aggregator
        # Plan numbers start from the clock: a restarted coordinator never gives a number a
        # launcher still follows from its predecessor (2**20 plans a second to spare).
        self._next = int(time.time()) << 20
        self._version = -1  # of the membership the plan was made from
        self.handovers = 0  # aggregators replaced (lost, left or moved)

    @property
    def active(self) -> bool:
        return bool(self._aggregators)

    def refresh(self, records: list[NodeRecord], version: int) -> list[tuple[int, str, str]]:
        """Plan again from the node table when it changed since the last plan (``version``:
        the membership's). Returns the handovers made: (group, old aggregator, new one)."""
        if version == self._version:
            return []
        self._version = version
        size = self.group_size
        ranked: dict[int, list[tuple[int, NodeRecord]]] = {}
        count = 0
        for r in records:
            rank = r.fields.get("group_rank")
            if r.lost or r.left or not isinstance(rank, int) or rank < 0:
                continue
            count += 1
            ranked.setdefault(rank // max(1, size), []).append((rank, r))
        if size <= 1 or count <= size:
            ranked = {}
        handovers: list[tuple[int, str, str]] = []
        aggregators: dict[int, str] = {}
        wanted: dict[str, tuple[str, str, int]] = {}  # node -> (via, addr, group)
        for group, members in ranked.items():
            if len(members) < 2:
                continue
            members.sort(key=lambda m: m[0])
            ids = {r.node_id for _, r in members}
            old = self._aggregators.get(group)
            away = [r for _, r in members if r.host != self.coordinator_host]
            chosen = old if old in ids else (away or [members[0][1]])[0].node_id
            if old is not None and old != chosen:
                handovers.append((group, old, chosen))
            aggregators[group] = chosen
            addr = next(r.fields.get("aggr_addr") or "" for _, r in members
                        if r.node_id == chosen)
            for _, r in members:
                if r.node_id == chosen:
                    wanted[r.node_id] = (chosen, "", group)
                else:
                    # Pointed at the aggregator once it says where it listens.
                    wanted[r.node_id] = (chosen, addr, group) if addr else ("", "", group)
        for node, plan in list(self._plans.items()):
            if node not in wanted:
                wanted[node] = ("", "", -1) if plan.via else (plan.via, plan.addr, plan.group)
        for node, (via, addr, group) in wanted.items():
            plan = self._plans.get(node)
            if plan is None and not via:
                continue  # direct and never told otherwise: nothing to say
            if plan is None or (plan.via, plan.addr, plan.group) != (via, addr, group):
                self._next += 1
                self._plans[node] = Plan(self._next, via, addr, group)
        self._aggregators = aggregators
        self.handovers += len(handovers)
        return handovers

    def plan_of(self, node_id: str) -> Plan | None:
        return self._plans.get(node_id)

    def tell(self, node_id: str, following: int | None) -> dict[str, Any] | None:
        """The ``aggregate`` directive for ``node_id`` when the plan it follows
        (``following``; None: it named none) is not its current one; else None."""
        plan = self._plans.get(node_id)
        if plan is None or plan.number == (following or 0):
            return None
        return plan.directive()

    def forget(self, node_id: str) -> None:
        """``node_id`` left the job: no plan to tell it any more."""
        self._plans.pop(node_id, None)

    def summary(self) -> dict[str, Any]:
        """The ``aggregation`` part of the status document. Callable from any thread, as
        the document is (membership's records are copied under its lock): the plans are
        copied first, in one step, while the coordinator's thread may be replanning."""
        members = sum(1 for p in list(self._plans.values()) if p.via and p.addr)
        return {"group_size": self.group_size, "groups": len(self._aggregators),
                "aggregators": sorted(self._aggregators.values())[:16],
                "members_via_aggregator": members, "handovers": self.handovers}
