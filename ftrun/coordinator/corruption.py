"""Silent data corruption: the replicas of a step compared, and what is done about a mismatch.

Each store reports, with every verified shard, the digest of the shard's replicated tensors
(DDP parameters and their optimizer state, replicated DTensor shards), derived from the chunk
hashes the rank took anyway (ftrun.snapshot.replicas). Those tensors are bit-identical on
every replica of a healthy job, so once every rank's shard of a step is in, the digests of
each replica group are compared (:func:`compare`):

- all equal: the step may commit;
- a strict majority agrees: the other ranks diverge, and are named;
- no strict majority (two replicas that differ, or an even split): every rank of the group is
  named and ``majority`` is false: which one is wrong cannot be told.

A step whose replicas disagree never commits: it is *dead* (ftrun.coordinator.commits) and
listed as ``disagreed`` to the stores, which discard their shards of it, so a restore loads
the newest step the replicas agreed on. :class:`CorruptionPolicy` acts on the finding
(``--on-corruption``): ``warn`` records it; ``restart`` kills the named ranks, so that the
whole job restarts from that step; ``isolate`` also excludes the culprit's host. Under
``restart`` a host named a second time (by a majority) is isolated: a repeat is a bad host,
not a cosmic ray. Ranks named without a majority are restarted, never isolated.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrun.coordinator.api import RESPONSES, Action

log = logging.getLogger(__name__)

MAX_STEPS = 64  # steps whose reports are held while their other ranks' shards come in
MAX_FINDINGS = 20  # kept for the status document


@dataclass(frozen=True)
class Report:
    """One rank's digest of one replica group at one step."""

    rank: int
    node: str
    digest: str
    parts: tuple[str, ...]
    names: tuple[tuple[str, str, int], ...] = ()  # per part, from the group's lead


@dataclass(frozen=True)
class Divergence:
    """The replicas of ``group`` at ``step`` differ: ``ranks`` diverge from the majority
    (with ``majority`` false: no majority, every rank of the group is named)."""

    epoch: str
    step: int
    group: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]  # index-aligned with ranks
    majority: bool
    members: int
    tensors: tuple[str, ...]  # the tensors in the parts that differ

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "group": self.group,
                "ranks": list(self.ranks), "nodes": list(self.nodes),
                "majority": self.majority, "replicas": self.members,
                "tensors": list(self.tensors)}


def _describe(names: tuple[str, str, int]) -> str:
    first, last, n = names
    if n <= 1:
        return first
    return f"{first} .. {last} ({n} tensors)"


def compare(epoch: str, step: int, group: str, reports: dict[int, Report]) -> Divergence | None:
    """The divergence among one group's reports of one step (None: all equal, or fewer than
    two replicas, so nothing to compare)."""
    if len(reports) < 2:
        return None
    counts = Counter(r.digest for r in reports.values())
    if len(counts) == 1:
        return None
    top, votes = counts.most_common(1)[0]
    majority = votes * 2 > len(reports)
    named = sorted(r for r, rep in reports.items() if not majority or rep.digest != top)
    # Each named rank against the most common digest (or, holding it, against another one):
    # the parts where they differ name the tensors. Linear in the replicas.
    reference = next(rep for rep in reports.values() if rep.digest == top)
    other = next(rep for rep in reports.values() if rep.digest != top)
    differing: set[int] = set()
    for rank in named:
        rep = reports[rank]
        o = reference if rep.digest != top else other
        differing |= {i for i, (a, b) in enumerate(zip(rep.parts, o.parts, strict=False))
                      if a != b}
        if len(rep.parts) != len(o.parts):
            differing |= set(range(min(len(rep.parts), len(o.parts)),
                                   max(len(rep.parts), len(o.parts))))
    names = next((rep.names for rep in reports.values() if rep.names), ())
    tensors = tuple(_describe(names[i]) if i < len(names) else f"part {i}"
                    for i in sorted(differing))
    return Divergence(epoch, step, group, tuple(named), tuple(reports[r].node for r in named),
                      majority, len(reports), tensors)


def _report(rank: int, node: str, b: dict[str, Any]) -> Report:
    names = tuple((str(n[0]), str(n[1]), int(n[2])) for n in b.get("names") or ())
    return Report(rank, node, str(b["digest"]), tuple(b["parts"]), names)


@dataclass
class ReplicaCheck:
    """The replicas' digests of each step, held until its last rank's shard is in.

    Owned by a CommitTracker (under its caller's lock): :meth:`note` with each verified
    shard's report, :meth:`agree` when a step is complete. New divergences are appended to
    ``found`` for whoever records and acts on them.
    """

    # (epoch, step) -> group -> rank -> (node, the report's digest entry), as received: the
    # common case (all equal) is decided on the digests alone.
    _steps: dict[tuple[str, int], dict[str, dict[int, tuple[str, dict[str, Any]]]]] = field(
        default_factory=dict)
    found: list[Divergence] = field(default_factory=list)  # drained by the caller
    checked: int = 0  # steps compared
    disagreed: int = 0  # steps refused

    def note(self, body: dict[str, Any]) -> None:
        entries = body.get("replicas")
        if not entries:
            return
        key = (body["epoch"], body["step"])
        held = self._steps.get(key)
        if held is None:
            held = self._steps[key] = {}
            while len(self._steps) > MAX_STEPS:
                del self._steps[min(self._steps, key=lambda k: k[1])]
        node = body.get("node_id", "")
        for b in entries:
            held.setdefault(b["group"], {})[body["rank"]] = (node, b)

    def agree(self, epoch: str, step: int) -> bool:
        """Whether every replica group of ``step`` holds equal digests (True when nothing was
        reported: without replicas there is nothing to compare). Forgets the step."""
        held = self._steps.pop((epoch, step), None)
        for key in [k for k in self._steps if k[0] == epoch and k[1] < step]:
            del self._steps[key]  # older steps that never completed
        if not held:
            return True
        self.checked += 1
        found = []
        for group, got in sorted(held.items()):
            if len({b["digest"] for _, b in got.values()}) == 1:
                continue
            d = compare(epoch, step, group,
                        {rank: _report(rank, node, b) for rank, (node, b) in got.items()})
            if d is not None:
                found.append(d)
        if found:
            self.disagreed += 1
            self.found.extend(found)
        return not found


class CorruptionPolicy:
    """What the coordinator does about a divergence (``--on-corruption``).

    ``direct(node, action, data)`` sends a launcher a directive; ``isolate(host, reason,
    evidence)`` excludes a host and says whether it could (not without the coordinator's
    detection service: then the ranks are restarted instead); ``host_of(node)`` names a
    node's host; ``record(type, node, data)`` writes the event log.
    """

    def __init__(self, action: str, *, direct: Callable[[str, str, dict[str, Any]], str],
                 isolate: Callable[[str, str, dict[str, Any]], bool],
                 host_of: Callable[[str], str | None],
                 record: Callable[[str, str | None, dict[str, Any]], None],
                 coordinator_host: str) -> None:
        if action not in RESPONSES:
            raise ValueError(f"on_corruption={action!r}: use one of {', '.join(RESPONSES)}")
        self.action = Action(action)
        self._direct = direct
        self._isolate = isolate
        self._host_of = host_of
        self._record = record
        self._coordinator_host = coordinator_host
        self._seen: set[tuple[str, tuple[int, ...]]] = set()  # (epoch, ranks) acted on
        self._culprit_hosts: Counter[str] = Counter()
        self.findings: list[dict[str, Any]] = []

    def _decide(self, d: Divergence, hosts: list[str]) -> Action:
        action = self.action
        if not d.majority:
            # Which replica is wrong is not known: never isolate a host for it.
            return Action.RESTART if action == Action.ISOLATE else action
        self._culprit_hosts.update(hosts)
        if action == Action.RESTART and any(self._culprit_hosts[h] > 1 for h in hosts):
            action = Action.ISOLATE  # the same host again: not a one-off
        if action == Action.ISOLATE:
            reason = f"silent data corruption in step {d.step} (ranks {list(d.ranks)})"
            isolated = [h for h in hosts if h != self._coordinator_host
                        and self._isolate(h, reason, {"corruption": d.to_json()})]
            if not isolated:
                log.error("cannot isolate %s (the coordinator's host, or no detection "
                          "service): restarting instead", ", ".join(hosts) or "the host")
                return Action.RESTART
        return action

    def handle(self, d: Divergence) -> None:
        """Record ``d`` and act on it, once per epoch and set of ranks: the steps after it
        diverge too until the job restarts (DDP never re-syncs parameters)."""
        if (d.epoch, d.ranks) in self._seen:
            log.info("step %d: replicas of %s still differ (ranks %s); already acted on",
                     d.step, d.group, list(d.ranks))
            return
        self._seen.add((d.epoch, d.ranks))
        hosts = sorted({h for n in d.nodes if (h := self._host_of(n))})
        action = self._decide(d, hosts)
        entry = {**d.to_json(), "action": str(action), "time": time.time()}
        self.findings.append(entry)
        del self.findings[:-MAX_FINDINGS]
        who = "diverge from the majority" if d.majority else \
            f"differ ({d.members} replicas, no majority: which is wrong is unknown)"
        log.error("silent data corruption: step %d: rank(s) %s %s in %s (action: %s); the "
                  "step is never restored", d.step, list(d.ranks), who,
                  ", ".join(d.tensors) or d.group, action)
        self._record("corruption_detected", d.nodes[0] if d.nodes else None, entry)
        if action != Action.RESTART:
            return  # warn; or isolated: its launchers leave, the others restart without it
        by_node: dict[str, list[int]] = {}
        for node, rank in zip(d.nodes, d.ranks, strict=True):
            by_node.setdefault(node, []).append(rank)
        for node, ranks in sorted(by_node.items()):
            self._direct(node, Action.RESTART, {
                "ranks": ranks, "reason": f"silent data corruption in step {d.step}"})

    def status(self, check: ReplicaCheck) -> dict[str, Any]:
        return {"on_corruption": str(self.action), "checked_steps": check.checked,
                "disagreed_steps": check.disagreed, "findings": list(self.findings[-5:])}
