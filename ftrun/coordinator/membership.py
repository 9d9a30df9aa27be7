"""Which nodes are in the job: what each launcher last said, and which went quiet.

A node joins with its first message (``hello``, ``heartbeat``, anything naming it), is
refreshed by every message, leaves with ``bye``, and is *lost* after ``node_timeout_s``
without a message. Thread-safe; the coordinator's serving thread is the only writer.

**Full heartbeats and keep-alives.** A launcher sends its state and workers (a heartbeat of
a couple of kilobytes, costly to check) only when something other than its workers' step and
progress age changed, or every :data:`ftrun.coordinator.client.FULL_EVERY_S`; otherwise a
``keepalive`` naming the ``serial`` of its last full heartbeat. The node keeps what it had. A
keep-alive that names another serial (the coordinator restarted, or the full heartbeat was
lost) marks the node's workers *stale*, and the coordinator asks for a full heartbeat.

**Lost, and overload.** Silence is measured up to the last moment the serving thread had read
everything queued (``caught_up``), not up to now: a heartbeat still waiting in a queue is not
silence. An overloaded coordinator therefore declares nobody lost for the time it is behind
(it says so in the status document) instead of calling healthy nodes lost.

**Reports through an aggregator** (:mod:`ftrun.coordinator.aggregation`). A node whose last
beat came in its group aggregator's ``aggregate`` remembers it (``via``). While that
aggregator has been silent about as long as the node (no later message from it than
:data:`VIA_SLACK_S` after the node's last beat), the silence is the aggregator's, not the
node's: the node is not judged, neither by the timeout nor early. When the aggregator is
declared lost or leaves, its members' silence is counted from then (the *handover*): each
member has fallen back, or soon falls back, to reporting directly; it is judged by the
timeout (not early) until it has beaten twice again, and as any node after. A member that
went down with its aggregator is lost one timeout after its aggregator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ftrun.coordinator.api import NodeState, RankHealth

# Worker states (lower-cased) that count as running, and as failed.
WORKER_RUNNING = frozenset({"running", "healthy"})
WORKER_BAD = frozenset({"failed", "unhealthy"})
# The top-level heartbeat fields a node record keeps (its workers are kept apart).
HEARTBEAT_FIELDS = ("group_rank", "group_world_size", "restarts", "max_restarts",
                    "last_error", "probe_addr", "extra", "aggr_addr")
# A node is lost early (:meth:`Membership.check_lost_early`) when silent for this many of its
# heartbeat intervals, at least EARLY_LOST_MIN_S, and EARLY_LOST_JITTER times the longest
# recent gap between its beats. On 2 CPUs at load 16-22 a live launcher's heartbeats (every
# 1 s) were measured up to 2.9 s apart.
EARLY_LOST_BEATS = 3.0
EARLY_LOST_MIN_S = 3.0
EARLY_LOST_JITTER = 1.5
# How fast the longest recent gap is forgotten (per beat).
GAP_MAX_DECAY = 0.98
# A node that reports through an aggregator is not judged while the aggregator's last
# message came less than this after the node's last beat (see the module docstring): a
# member's beat can miss one of the aggregator's sends and ride in the next.
VIA_SLACK_S = 2.5


def worker_running(worker: dict[str, Any]) -> bool:
    return worker.get("exitcode") is None and str(worker.get("state", "")).lower() in WORKER_RUNNING


def worker_bad(worker: dict[str, Any]) -> bool:
    return (str(worker.get("state", "")).lower() in WORKER_BAD
            or worker.get("exitcode") not in (None, 0))


def suspect_ranks(workers: list[dict[str, Any]]) -> list[int]:
    """Ranks of the live workers their launcher judged suspect."""
    return sorted(w["rank"] for w in workers
                  if w.get("health") == RankHealth.SUSPECT and w.get("exitcode") is None)


@dataclass
class NodeRecord:
    node_id: str
    host: str
    pid: int
    first_seen: float
    last_seen: float  # unix time of the last message of any kind
    last_seen_mono: float
    state: str = NodeState.INIT  # what the launcher last reported
    fields: dict[str, Any] = field(default_factory=dict)  # HEARTBEAT_FIELDS last reported
    workers: list[dict[str, Any]] = field(default_factory=list)
    serial: int | None = None  # of the last full heartbeat
    workers_stale: bool = False
    lost: bool = False
    left: bool = False
    exitcode: int | None = None
    heartbeats: int = 0
    full_mono: float = 0.0  # when the last full heartbeat arrived
    keepalives: int = 0
    beat_mono: float = 0.0  # when the last heartbeat or keep-alive arrived
    beat_gap_s: float = 0.0  # the usual time between them (moving average; 0: unknown yet)
    beat_gap_max_s: float = 0.0  # the longest recent one (decays by GAP_MAX_DECAY per beat)
    via: str | None = None  # the aggregator its last beat came through (None: directly)
    # Derived from ``workers`` on each full heartbeat (the status summary reads only these).
    ranks: list[int] = field(default_factory=list)
    running: int = 0
    bad_worker: bool = False
    suspect: list[int] = field(default_factory=list)

    def beat(self, mono: float) -> None:
        """A heartbeat or keep-alive arrived at ``mono``: learn the node's interval."""
        if self.beat_mono:
            gap = mono - self.beat_mono
            self.beat_gap_s = gap if not self.beat_gap_s else 0.8 * self.beat_gap_s + 0.2 * gap
            self.beat_gap_max_s = max(gap, GAP_MAX_DECAY * self.beat_gap_max_s)
        self.beat_mono = mono

    def set_workers(self, workers: list[dict[str, Any]]) -> bool:
        """Take a full heartbeat's workers; True when what the summary counts changed."""
        before = (self.ranks, self.running, self.bad_worker, self.suspect, self.workers_stale)
        self.workers = workers
        self.ranks = sorted(w["rank"] for w in workers)
        self.running = sum(1 for w in workers if worker_running(w))
        self.bad_worker = any(worker_bad(w) for w in workers)
        self.suspect = suspect_ranks(workers)
        self.workers_stale = False
        return before != (self.ranks, self.running, self.bad_worker, self.suspect, False)


class Membership:
    """The node table."""

    def __init__(self, node_timeout_s: float) -> None:
        self.node_timeout_s = node_timeout_s
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeRecord] = {}
        self.version = 0  # bumped whenever a node joins, leaves, is lost or changes state

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)

    def records(self) -> list[NodeRecord]:
        """The records (live objects: read, do not change them)."""
        with self._lock:
            return list(self._nodes.values())

    def touch(self, node_id: str, host: str | None, pid: int | None, now: float,
              mono: float) -> tuple[NodeRecord, dict[str, Any] | None]:
        """A message from ``node_id``: returns its record and, when it (re)joined now, what
        to say about that."""
        with self._lock:
            return self._touch(node_id, host, pid, now, mono)

    def _touch(self, node_id: str, host: str | None, pid: int | None, now: float,
               mono: float) -> tuple[NodeRecord, dict[str, Any] | None]:
        node = self._nodes.get(node_id)
        if node is None:
            default_host = node_id.rsplit("/", 1)[0] if "/" in node_id else ""
            node = NodeRecord(node_id, host or default_host, pid or 0, now, now, mono)
            self._nodes[node_id] = node
            self.version += 1
            return node, {"host": node.host, "pid": node.pid}
        joined = None
        if node.lost or node.left:
            joined = {"host": host or node.host, "pid": pid or node.pid, "rejoined": True}
            node.lost = node.left = False
            node.exitcode = None
            self.version += 1
        node.last_seen, node.last_seen_mono = now, mono
        if host and host != node.host:
            node.host = host
        if pid and pid != node.pid:
            node.pid = pid
        return node, joined

    def heartbeat(self, body: dict[str, Any], now: float, mono: float,
                  via: str | None = None) -> tuple[NodeRecord, dict[str, Any] | None]:
        """Apply a full heartbeat (that came through aggregator ``via``, or directly): (record,
        what to say if it joined now)."""
        with self._lock:
            node, joined = self._touch(body["node_id"], body["host"], body["pid"], now, mono)
            node.via = via if via != node.node_id else None
            node.heartbeats += 1
            node.beat(mono)
            if node.state != body["state"]:
                node.state = body["state"]
                self.version += 1
            fields = {k: body.get(k) for k in HEARTBEAT_FIELDS}
            if fields != node.fields:
                node.fields = fields
                self.version += 1
            if node.set_workers(body["workers"]):
                self.version += 1
            node.serial = body.get("serial")
            node.full_mono = mono
        return node, joined

    def keepalive(self, node_id: str, same: int, now: float, mono: float,
                  via: str | None = None) -> tuple[NodeRecord, dict[str, Any] | None, bool]:
        """Apply a keep-alive (through aggregator ``via``, or directly): (record, joined,
        whether the node's workers are stale: this is not the full heartbeat they came with,
        and a full one is wanted)."""
        with self._lock:
            node, joined = self._touch(node_id, None, None, now, mono)
            node.via = via if via != node.node_id else None
            node.keepalives += 1
            node.beat(mono)
            if same == node.serial:
                return node, joined, False
            if not node.workers_stale:
                node.workers_stale = True
                self.version += 1
            return node, joined, True

    def leave(self, node_id: str, state: str, exitcode: int, now: float,
              mono: float) -> tuple[NodeRecord, dict[str, Any] | None]:
        with self._lock:
            node, joined = self._touch(node_id, None, None, now, mono)
            node.left = True
            node.state = state
            node.exitcode = exitcode
            self.version += 1
            self._hand_over({node_id}, mono)
        return node, joined

    def _covered(self, node: NodeRecord) -> bool:
        """Whether ``node``'s silence is its aggregator's (see the module docstring)."""
        if node.via is None:
            return False
        agg = self._nodes.get(node.via)
        return (agg is not None and not agg.lost and not agg.left
                and agg.last_seen_mono < node.last_seen_mono + VIA_SLACK_S)

    def _hand_over(self, gone: set[str], mono: float) -> None:
        """The aggregators ``gone`` were lost or left: their members' silence counts from
        ``mono`` (they report directly from now on, or through the next aggregator)."""
        for node in self._nodes.values():
            if node.via in gone:
                node.via = None
                node.last_seen_mono = max(node.last_seen_mono, mono)
                # Its beats' rhythm restarts: judged by the timeout, not early, until it
                # has beaten twice again (its first direct report may take a few seconds).
                node.beat_mono = node.beat_gap_s = node.beat_gap_max_s = 0.0

    def check_lost(self, caught_up_mono: float) -> list[tuple[str, float]]:
        """Mark lost the nodes silent for longer than the timeout up to ``caught_up_mono``
        (the last time every queued message had been read); returns (node, silence)."""
        lost: list[tuple[str, float]] = []
        limit = caught_up_mono - self.node_timeout_s
        with self._lock:
            # Judged before any is marked: an aggregator marked lost in this pass still
            # covers its members until the handover below.
            silent = [node for node in self._nodes.values()
                      if node.last_seen_mono < limit and not node.lost and not node.left]
            for node in [n for n in silent if not self._covered(n)]:
                node.lost = True
                lost.append((node.node_id, caught_up_mono - node.last_seen_mono))
            if lost:
                self.version += 1
                self._hand_over({n for n, _ in lost}, caught_up_mono)
        return lost

    def check_lost_early(self, caught_up_mono: float) -> list[tuple[str, float, float]]:
        """Mark lost the nodes silent for :data:`EARLY_LOST_BEATS` of their heartbeat
        intervals (at least :data:`EARLY_LOST_MIN_S` and :data:`EARLY_LOST_JITTER` times
        their longest recent gap: a node on a loaded host gets more, less than the timeout) up to
        ``caught_up_mono``; returns (node, silence, the limit it passed). The caller asks only
        while it has evidence that a node went away (another node's workers just failed): a
        node merely slow to report is not called lost for missing a beat or two otherwise.
        A node whose interval is not known yet (fewer than two beats) is left to the timeout."""
        lost: list[tuple[str, float, float]] = []
        with self._lock:
            found: list[tuple[NodeRecord, float, float]] = []
            for node in self._nodes.values():
                if node.lost or node.left or not node.beat_gap_s:
                    continue
                limit = max(EARLY_LOST_MIN_S, EARLY_LOST_BEATS * node.beat_gap_s,
                            EARLY_LOST_JITTER * node.beat_gap_max_s)
                silent = caught_up_mono - node.last_seen_mono
                if limit < self.node_timeout_s and silent > limit:
                    found.append((node, silent, limit))
            # Judged before any is marked (as in check_lost).
            for node, silent, limit in [f for f in found if not self._covered(f[0])]:
                node.lost = True
                lost.append((node.node_id, silent, limit))
            if lost:
                self.version += 1
                self._hand_over({n for n, _, _ in lost}, caught_up_mono)
        return lost

    def note_error(self, node_id: str, text: str) -> None:
        """Replace what ``node_id`` last reported as its error (a lost node's cause, for the
        status document; its next heartbeat, if it comes back, says its own)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None and node.fields.get("last_error") != text:
                node.fields = {**node.fields, "last_error": text}
                self.version += 1

    def gone(self, node_id: str, mono: float) -> bool:
        """Left, lost, or silent past the timeout (False for a node never seen)."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        return node.left or node.lost or mono - node.last_seen_mono > self.node_timeout_s
