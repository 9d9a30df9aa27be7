"""C4-style analysis of collective timings: pure logic, no I/O.

The coordinator feeds every rank's ``coll_report`` and every launcher's ``probe_result``
into a :class:`Detector` and calls :meth:`Detector.analyse` about every 0.5 s. Only local
durations, waits and sequence numbers are compared across ranks, never clock readings. Times
passed in (``now``) are the coordinator's monotonic clock. Thresholds: docs/detection.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from ftrun.coordinator.api import RESPONSES, Action, FindingKind
from ftrun.errors import ConfigError

# The vocabulary (ftrun.coordinator.api), shared with the directives: the actions a finding
# may get (--on-hang, --on-slow), and the kinds of finding.
ACTIONS: tuple[Action, ...] = RESPONSES
KINDS: tuple[FindingKind, ...] = tuple(FindingKind)
SILENT_GAPS = 16  # report gaps per rank that set how long a silence must last to count
SILENT_GAP_FACTOR = 2.0
MAX_RETIRED = 16  # earlier worlds remembered (their late reports are ignored)
SUMMARY_STALE_S = 2.5  # a sender's summary older than this is out of the analysis (they
# come every second at least: ftrun.coordinator.collsum.QUIET_SUMMARY_S)


@dataclass(frozen=True)
class DetectConfig:
    """What the analysis looks for and what the coordinator does about it.

    Every threshold is documented with its default in docs/detection.md.
    """

    on_hang: str = "restart"       # warn | restart | isolate
    on_slow: str = "warn"          # warn | restart | isolate
    on_corruption: str = "restart"  # warn | restart | isolate (ftrun.coordinator.corruption)
    isolate_hook: str | None = None
    hang_s: float = 3.0            # floor of the hang threshold
    busy_hang_s: float = 60.0      # floor when the culprit is alive and in no collective
    hang_factor: float = 10.0      # ... or this many times the group's typical wait
    silent_s: float = 3.0          # a rank silent this long while others wait on it
    window: int = 20               # ops per group in the slow windows
    history: int = 3               # ops kept per group: window * history
    min_ops: int = 8               # informative ops needed before slow_rank can be named
    slow_share: float = 0.75       # caused at least this share of the window's waiting
    slow_min_s: float = 0.05       # lateness floor (at least 2 * interval_s as well)
    slow_z: float = 3.0            # lateness against the others' spread (robust z)
    comm_factor: float = 3.0       # slow_comm: op time vs the group's baseline
    comm_min_s: float = 0.05       # ... and at least this much more (and 2 * interval_s)
    probe_frac: float = 1 / 3      # a probe cell / row / column below this share of the median
    max_probe_pairs: int = 64      # host pairs proposed per slow or hung group

    def __post_init__(self) -> None:
        for name in ("on_hang", "on_slow", "on_corruption"):
            value = getattr(self, name)
            if value not in ACTIONS:
                raise ConfigError(f"{name}={value!r} is not an action: use one of "
                                  f"{', '.join(ACTIONS)}")
        if self.isolate_hook is not None and not self.isolate_hook.strip():
            raise ConfigError("isolate_hook is empty: give a shell command or leave it unset")
        for name in ("hang_s", "busy_hang_s", "silent_s", "slow_min_s", "comm_min_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value!r} must be a finite number of seconds > 0")
        for name in ("hang_factor", "comm_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ConfigError(f"{name}={value!r} must be a finite factor >= 1")
        if not (math.isfinite(self.slow_z) and self.slow_z > 0):
            raise ConfigError(f"slow_z={self.slow_z!r} must be a finite number > 0")
        if not 0.5 <= self.slow_share <= 1:
            raise ConfigError(f"slow_share={self.slow_share!r} must lie in [0.5, 1]: a rank "
                              "that caused less than half the waiting is not the one slowing "
                              "the group")
        if not 0 < self.probe_frac < 1:
            raise ConfigError(f"probe_frac={self.probe_frac!r} must lie in (0, 1)")
        for name, low in (("window", 4), ("history", 2), ("max_probe_pairs", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}={value!r} must be an integer >= {low}")
        if not isinstance(self.min_ops, int) or not 2 <= self.min_ops <= self.window:
            raise ConfigError(f"min_ops={self.min_ops!r} must be an integer in "
                              f"[2, window={self.window}]")


@dataclass(frozen=True)
class Finding:
    """One detected condition; ``evidence`` is JSON-serialisable."""

    kind: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    nodes: tuple[str, ...]
    evidence: dict = field(default_factory=dict)
    summary: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": list(self.ranks), "hosts": list(self.hosts),
                "nodes": list(self.nodes), "evidence": self.evidence, "summary": self.summary}


class _Member:
    """A rank's latest counters in one group."""

    __slots__ = ("enqueued", "completed", "waiting_s", "op", "at")

    def __init__(self) -> None:
        self.enqueued = -1
        self.completed = -1
        self.waiting_s: float | None = None
        self.op: str | None = None
        self.at = 0.0


class _Rank:
    __slots__ = ("rank", "node_id", "host", "seen", "seq", "interval_s", "groups", "gaps",
                 "left", "idle_s")

    def __init__(self, rank: int, node_id: str, host: str) -> None:
        self.rank = rank
        self.node_id = node_id
        self.host = host
        self.seen = 0.0
        self.seq = -1
        self.interval_s = 0.02
        self.groups: dict[str, _Member] = {}
        self.gaps: deque[float] = deque(maxlen=SILENT_GAPS)  # between its recent reports
        self.left = False  # its last report said it leaves: its silence is not a hang
        self.idle_s: float | None = None  # idle for this long as of its last report (seen)

    def idle_for(self, now: float) -> float:
        """Seconds this rank has been idle as of ``now`` (0: busy at its last report)."""
        return 0.0 if self.idle_s is None else self.idle_s + (now - self.seen)

    def silent_after(self, floor_s: float) -> float:
        """Silence that names this rank: ``floor_s``, or SILENT_GAP_FACTOR x the longest gap
        between its recent reports where that is longer (an overloaded host delays a live
        rank's reports by seconds: 3.1 s seen at a load of 20 on 2 CPUs)."""
        return max(floor_s, SILENT_GAP_FACTOR * max(self.gaps, default=0.0))


class _Group:
    __slots__ = ("name", "size", "members", "ops", "dirty", "waiting", "slow_seen",
                 "baseline", "interval_s", "start", "newest", "sources")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.members: dict[int, _Member] = {}
        # seq -> {rank: duration_s} for the ranks that listed it (the others took < interval).
        self.ops: dict[int, dict[int, float]] = {}
        self.dirty = True
        self.waiting = False
        self.slow_seen = -1          # newest op every member completed, at the last slow pass
        self.baseline: float | None = None
        self.interval_s = 0.02
        # Ops from ``start`` on are fully observed: every member reported since before them.
        self.start = 0
        self.newest = -1             # highest completed seq any member reported
        # Summarised (ftrun.coordinator.collsum): sender -> (received at, its group entry).
        self.sources: dict[str, tuple[float, dict]] = {}


def _mad(values: list[float], centre: float) -> float:
    return median(abs(v - centre) for v in values) if values else 0.0


class Detector:
    """Aligns collectives by (group, sequence number) across ranks and names culprits.

    Call order (the coordinator): :meth:`add_report` / :meth:`add_probe_result` as messages
    arrive, :meth:`analyse` every ~0.5 s (new findings only), :meth:`probe_plan` after a
    comm_hang or slow_comm finding, :meth:`status` for ``ftrun status``, :meth:`reset` when a
    new restart round begins (reports of a newer ``restart`` also reset it).
    """

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.generation = -1
        # The world (rendezvous round) the reports describe, and the worlds it replaced:
        # sequence numbers restart with every world, and a rank's restart count is its
        # node's (a spare that joins later has counted fewer restarts than the survivors).
        self.world: str | None = None
        self._retired: list[str] = []
        self._ranks: dict[int, _Rank] = {}
        self._groups: dict[str, _Group] = {}
        self._active: dict[tuple, Finding] = {}       # condition key -> finding
        self._keys: dict[tuple[str, str], set[tuple]] = {}   # (group, pass) -> keys
        self._probe_keys: set[tuple] = set()
        self._probes: dict[tuple[str, str], dict] = {}  # (src host, dst host) -> cell
        self._host_node: dict[str, str] = {}
        self._probes_dirty = False
        self._planned: set[tuple[str, str]] = set()
        self._plan: dict[str, list[dict]] = {}
        # Summaries (ftrun.coordinator.collsum): when each launcher was last covered by one,
        # its ranks (roster), each sender's silent ranks, and the ranks that left.
        self._node_seen: dict[str, float] = {}
        self._node_ranks: dict[str, list[int]] = {}
        self._src_silent: dict[str, tuple[float, list[list]]] = {}
        self._left: set[int] = set()  # ranks whose last report said they leave (this world)
        self.summaries = 0

    # ------------------------------------------------------------------ input
    def reset(self, restart: int | None = None) -> None:
        """Forget every rank and group (a new restart round); the probe matrix stays."""
        self._ranks.clear()
        self._groups.clear()
        self._node_seen.clear()
        self._node_ranks.clear()
        self._src_silent.clear()
        self._left.clear()
        for key in [k for k in self._active if k[0] not in ("slow_host", "slow_link")]:
            del self._active[key]
        probe_keys = self._keys.get(("probe", ""))
        self._keys.clear()
        if probe_keys is not None:
            self._keys[("probe", "")] = probe_keys
        self._planned.clear()
        self._plan.clear()
        if restart is not None:
            self.generation = restart

    def add_report(self, body: dict, now: float) -> None:
        """One validated ``coll_report`` body. Cost: O(groups in the report + done entries)."""
        if not self._enter_world(body):
            return                                   # a report of an earlier world
        rank_id = body["rank"]
        rank = self._ranks.get(rank_id)
        if rank is None:
            rank = self._ranks[rank_id] = _Rank(rank_id, body["node_id"], body["host"])
        elif body["seq"] <= rank.seq and body["node_id"] == rank.node_id:
            return                                   # a stale or repeated report
        rank.node_id = body["node_id"]
        rank.host = body["host"]
        rank.seq = body["seq"]
        gap = now - rank.seen if rank.seen else None
        if gap is not None and gap < rank.silent_after(self.config.silent_s):
            rank.gaps.append(gap)  # jitter; not a silence long enough to have named it
        rank.seen = now
        rank.left = bool(body.get("leaving", False))
        idle = body.get("idle_s")
        rank.idle_s = float(idle) if isinstance(idle, (int, float)) and idle >= 0 else None
        rank.interval_s = interval = body["interval_s"]
        self._host_node[rank.host] = rank.node_id
        keep = self.config.window * self.config.history
        for g in body["groups"]:
            name = g["pg"]
            group = self._groups.get(name)
            if group is None:
                group = self._groups[name] = _Group(name, g["size"])
            member = rank.groups.get(name)
            if member is None:
                member = rank.groups[name] = group.members[rank_id] = _Member()
                group.start = max(group.start, g["completed"] + 1)
            group.members[rank_id] = member
            member.enqueued = g["enqueued"]
            member.completed = g["completed"]
            member.waiting_s = g["waiting_s"]
            member.op = g.get("op")
            member.at = now
            group.dirty = True
            group.interval_s = interval
            if member.waiting_s is not None:
                group.waiting = True
            if member.completed > group.newest:
                group.newest = member.completed
            ops = group.ops
            for entry in g.get("done") or ():
                if len(entry) != 2:
                    continue
                seq, duration = entry
                if (not isinstance(seq, int) or not isinstance(duration, (int, float))
                        or not math.isfinite(duration) or duration < 0):
                    continue
                op = ops.get(seq)
                if op is None:
                    op = ops[seq] = {}
                op[rank_id] = float(duration)
                if seq <= group.newest - keep:
                    del ops[seq]                      # older than anything analysed
            if len(ops) > keep + self.config.window:   # amortised: sort once per window
                for seq in sorted(ops)[:len(ops) - keep]:
                    del ops[seq]

    def _enter_world(self, body: dict) -> bool:
        """Follow the world a report or summary names; False: it is of an earlier one."""
        world = body.get("world")
        if world is not None:
            if world in self._retired:
                return False
            if world != self.world:
                if self.world is not None:
                    self._retired = [*self._retired[-(MAX_RETIRED - 1):], self.world]
                self.world = world
                self.reset(self.generation + 1)
            return True
        restart = body["restart"]
        if restart < self.generation:
            return False
        if restart > self.generation:
            self.reset(restart)
        return True

    def add_summary(self, body: dict, now: float) -> None:
        """One ``coll_summary`` (ftrun.coordinator.collsum): a launcher's or a group's ranks,
        reduced. Cost: O(process groups x classes), plus the roster when it comes."""
        if not self._enter_world(body):
            return
        self.summaries += 1
        src = body["node_id"]
        for node in body["nodes"]:
            self._node_seen[node] = now
        roster = body.get("roster")
        if roster:
            by_node: dict[str, list[int]] = {}
            for entry in roster:
                if len(entry) != 3 or not isinstance(entry[0], int) \
                        or not all(isinstance(x, str) for x in entry[1:]):
                    continue  # not [rank, node_id, host]
                rank_id, node, host = entry
                rank = self._ranks.get(rank_id)
                if rank is None:
                    rank = self._ranks[rank_id] = _Rank(rank_id, node, host)
                rank.node_id, rank.host, rank.seen = node, host, now
                self._host_node[host] = node
                by_node.setdefault(node, []).append(rank_id)
            self._node_ranks.update(by_node)
        self._src_silent[src] = (now, [e for e in body.get("silent") or ()
                                       if len(e) == 2 and isinstance(e[0], int)
                                       and isinstance(e[1], (int, float))
                                       and math.isfinite(e[1])])
        self._left.update(body.get("left") or ())
        for g in body["groups"]:
            name = g["pg"]
            group = self._groups.get(name)
            if group is None:
                group = self._groups[name] = _Group(name, g["size"])
            group.size = max(group.size, g["size"])
            group.sources[src] = (now, g)
            group.interval_s = body["interval_s"]
            group.dirty = True
            for seq, duration in g.get("ops") or ():
                if isinstance(seq, int) and isinstance(duration, (int, float)) \
                        and math.isfinite(duration) and duration >= 0:
                    longest = max(float(duration), group.ops.get(seq, {}).get(-1, 0.0))
                    group.ops[seq] = {-1: longest}
            keep = self.config.window * self.config.history
            if len(group.ops) > keep + self.config.window:
                for seq in sorted(group.ops)[:len(group.ops) - keep]:
                    del group.ops[seq]
            if any(c.get("waiting") for c in g["classes"]):
                group.waiting = True

    def add_probe_result(self, body: dict, now: float) -> None:
        """One ``probe_result``: a row of the host x host bandwidth/latency matrix."""
        src = body["host"]
        self._host_node[src] = body["node_id"]
        for r in body["results"]:
            dst = r["host"]
            self._host_node.setdefault(dst, r["peer"])
            mb_s = r.get("mb_s")
            if r.get("error") or mb_s is None or not math.isfinite(mb_s):
                mb_s = 0.0                            # unreachable counts as down
            self._probes[(src, dst)] = {"mb_s": float(mb_s), "rtt_s": r.get("rtt_s"),
                                        "error": r.get("error"), "at": now}
        self._probes_dirty = True

    # --------------------------------------------------------------- analysis
    def analyse(self, now: float) -> list[Finding]:
        """Findings whose condition is new since the last call (a cleared one returning is new)."""
        new: list[Finding] = []
        for group in self._groups.values():
            if group.sources:
                if group.dirty or group.waiting:
                    self._replace(("hang", group.name), self._summary_hang_pass(group, now),
                                  new)
                group.dirty = False
                continue
            if group.dirty or group.waiting:
                self._replace(("hang", group.name), self._hang_pass(group, now), new)
            if group.dirty:
                slow = self._slow_pass(group)
                if slow is not None:
                    self._replace(("slow", group.name), slow, new)
            group.dirty = False
        if self._probes_dirty:
            self._probes_dirty = False
            self._replace(("probe", ""), self._probe_pass(), new)
        return new

    def _replace(self, slot: tuple[str, str], found: list[tuple[tuple, Finding]],
                 new: list[Finding]) -> None:
        old = self._keys.get(slot, set())
        keys = set()
        for key, finding in found:
            keys.add(key)
            if key not in old:
                new.append(finding)
                if finding.kind in ("comm_hang", "slow_comm"):
                    self._add_plan(finding)
            self._active[key] = finding
        for key in old - keys:
            self._active.pop(key, None)
        self._keys[slot] = keys

    def _who(self, ranks: list[int]) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
        ranks = sorted(ranks)
        hosts, nodes = [], []
        for r in ranks:
            info = self._ranks.get(r)
            if info is not None:
                if info.host not in hosts:
                    hosts.append(info.host)
                if info.node_id not in nodes:
                    nodes.append(info.node_id)
        return tuple(ranks), tuple(hosts), tuple(nodes)

    def _typical_wait(self, group: _Group) -> float:
        waits = [max(op.values()) for op in group.ops.values() if op]
        if not waits:
            return 0.0
        return median(waits[-self.config.window:]) if len(waits) >= 3 else 0.0

    def hang_threshold(self, group_name: str) -> float:
        """max(hang_s, hang_factor x the group's typical longest wait per op)."""
        group = self._groups.get(group_name)
        typical = self._typical_wait(group) if group is not None else 0.0
        return max(self.config.hang_s, self.config.hang_factor * typical)

    def _hang_pass(self, group: _Group, now: float) -> list[tuple[tuple, Finding]]:
        cfg = self.config
        waiters: dict[int, tuple[int, float]] = {}     # rank -> (op seq, effective wait)
        for r, m in group.members.items():
            if m.waiting_s is not None and not self._ranks[r].left:
                waiters[r] = (m.completed + 1, m.waiting_s + (now - m.at))
        group.waiting = bool(waiters)
        if not waiters:
            return []
        found: list[tuple[tuple, Finding]] = []
        threshold = self.hang_threshold(group.name)
        # A rank that said it leaves is not silent: its process exited or its training
        # function returned (the last ranks of a job to finish would otherwise be named hung
        # while the others' final waits, last reported a moment before, looked long).
        silent = [r for r in group.members if not self._ranks[r].left
                  and now - self._ranks[r].seen >= self._ranks[r].silent_after(cfg.silent_s)]
        live_waits = {r: w for r, w in waiters.items() if r not in silent}
        if silent and any(w >= cfg.silent_s for _, w in live_waits.values()):
            ranks, hosts, nodes = self._who(silent)
            longest = max(w for _, w in live_waits.values())
            ev = {"pg": group.name, "reason": "silent", "waiting_ranks": len(live_waits),
                  "longest_wait_s": round(longest, 3),
                  "silent_s": {str(r): round(now - self._ranks[r].seen, 3) for r in silent}}
            found.append((("hang", group.name, "silent", ranks), Finding(
                FindingKind.HANG, ranks, hosts, nodes, ev,
                f"hang: rank(s) {_fmt(ranks)} on {_fmt(hosts)} stopped reporting while "
                f"{len(live_waits)} rank(s) of group {group.name} wait "
                f"({longest:.1f} s)")))
            return found
        long_waits = {r: sw for r, sw in live_waits.items() if sw[1] >= threshold}
        if not long_waits:
            return found
        s = min(seq for seq, _ in long_waits.values())
        at_s = [r for r, (seq, _) in long_waits.items() if seq == s]
        behind = [r for r, m in group.members.items() if m.enqueued < s]
        if behind:
            culprits = self._minority(group, at_s, behind)
            if culprits:
                ranks, hosts, nodes = self._who(culprits)
                elsewhere = {}
                for r in culprits:
                    for name, m in self._ranks[r].groups.items():
                        if name != group.name and m.waiting_s is not None:
                            elsewhere[str(r)] = {"pg": name, "seq": m.completed + 1,
                                                 "op": m.op,
                                                 "waiting_s": round(m.waiting_s + now - m.at, 3)}
                longest = max(long_waits[r][1] for r in at_s)
                free = [r for r in culprits if str(r) not in elsewhere]
                idle = {str(r): round(self._ranks[r].idle_for(now), 3) for r in free}
                if free and min(idle.values()) < threshold:
                    # A culprit alive and in no collective that computes or writes may be
                    # saving or evaluating while the others wait at a barrier: only a much
                    # longer wait is a hang. One idle all along (a sleep, a lock, an empty
                    # queue) is hung: named from the others' wait, like one stuck elsewhere.
                    threshold = max(threshold, cfg.busy_hang_s)
                    if longest < threshold:
                        return found
                ev = {"pg": group.name, "seq": s, "op": group.members[at_s[0]].op,
                      "reason": "behind", "waiting_ranks": len(at_s),
                      "longest_wait_s": round(longest, 3), "threshold_s": round(threshold, 3),
                      "enqueued": {str(r): group.members[r].enqueued for r in culprits},
                      "waiting_elsewhere": elsewhere}
                if free:
                    ev["idle_s"] = idle
                found.append((("hang", group.name, s, ranks), Finding(
                    FindingKind.HANG, ranks, hosts, nodes, ev,
                    f"hang: rank(s) {_fmt(ranks)} on {_fmt(hosts)} never entered op {s} of "
                    f"group {group.name} that {len(at_s)} rank(s) wait in ({longest:.1f} s)")))
            return found
        # Every member entered op s: a communication hang once nobody finished it and even
        # the last to enter has waited past the threshold. A group of one rank talks to
        # nobody: its op can outlast the threshold only because the rank itself stalls (a
        # busy host, a long copy before it waits), which the launcher's own checks watch.
        if len(group.members) < group.size or group.size < 2:
            return found
        members = group.members
        if any(m.completed >= s for m in members.values()):
            return found
        if len(long_waits) < len(members):
            return found
        ranks, hosts, nodes = self._who(list(members))
        shortest = min(w for _, w in long_waits.values())
        ev = {"pg": group.name, "seq": s, "op": members[ranks[0]].op,
              "shortest_wait_s": round(shortest, 3), "threshold_s": round(threshold, 3),
              "hosts": list(hosts)}
        found.append((("comm_hang", group.name, s), Finding(
            FindingKind.COMM_HANG, ranks, hosts, nodes, ev,
            f"comm_hang: all {len(ranks)} ranks of group {group.name} entered op {s} and "
            f"none finished it in {shortest:.1f} s; hosts {_fmt(hosts)}")))
        return found

    def _summary_hang_pass(self, group: _Group, now: float) -> list[tuple[tuple, Finding]]:
        """:meth:`_hang_pass`'s rules on a summarised group's classes (ranks in the same
        state counted together; ftrun.coordinator.collsum). A tie between the waiting ranks
        and those behind names nobody here (the per-rank pass looks at side groups)."""
        cfg = self.config
        classes: list[tuple[dict, float]] = []  # (class, its summary's age)
        members = 0
        # A rank that said it leaves is not silent: its process exited or its training
        # function returned (at the end of a job, launchers stop one after the other).
        left = self._left
        for at, g in group.sources.values():
            age = now - at
            if age > SUMMARY_STALE_S:
                continue  # its launchers' ranks count as silent once their silence is long
            members += g["members"]
            classes += [(c, age) for c in g["classes"]]
        silent: dict[int, float] = {}
        for at, listed in self._src_silent.values():
            if now - at <= SUMMARY_STALE_S:
                for r, quiet in listed:
                    if quiet + now - at >= cfg.silent_s and r not in left:
                        silent[r] = quiet + now - at
        for node, seen in self._node_seen.items():
            if now - seen >= cfg.silent_s:
                for r in self._node_ranks.get(node, ()):
                    if r not in left:
                        silent.setdefault(r, now - seen)
        waiters = [(c, age) for c, age in classes if c.get("waiting")]
        group.waiting = bool(waiters)
        if not waiters:
            return []
        waiting = sum(c["waiting"] for c, _ in waiters)
        longest = max(c["waiting_max_s"] + age for c, age in waiters)
        if silent and longest >= cfg.silent_s:
            ranks, hosts, nodes = self._who(list(silent))
            ev = {"pg": group.name, "reason": "silent", "waiting_ranks": waiting,
                  "longest_wait_s": round(longest, 3), "summarised": True,
                  "silent_s": {str(r): round(q, 3) for r, q in sorted(silent.items())[:64]}}
            return [(("hang", group.name, "silent", ranks), Finding(
                FindingKind.HANG, ranks, hosts, nodes, ev,
                f"hang: rank(s) {_fmt(ranks[:16])}{' ...' if len(ranks) > 16 else ''} on "
                f"{_fmt(hosts[:8])}{' ...' if len(hosts) > 8 else ''} stopped reporting while "
                f"{waiting} rank(s) of group {group.name} wait ({longest:.1f} s)"))]
        threshold = self.hang_threshold(group.name)
        long = [(c, age) for c, age in waiters if c["waiting_max_s"] + age >= threshold]
        if not long:
            return []
        s = min(c["completed"] + 1 for c, _ in long)
        at_s = [(c, age) for c, age in long if c["completed"] + 1 == s]
        n_at = sum(c["waiting"] for c, _ in at_s)
        longest = max(c["waiting_max_s"] + age for c, age in at_s)
        behind = [c for c, _ in classes if c["enqueued"] < s]
        if behind:
            n_behind = sum(c["count"] for c in behind)
            if n_behind >= n_at:
                return []
            culprits = sorted(r for c in behind for r in c["ranks"])
            elsewhere = {str(e[0]): {"pg": e[1], "seq": e[2], "waiting_s": e[3]}
                         for c in behind for e in c.get("elsewhere") or ()
                         if len(e) == 4 and e[1] != group.name}
            if len(elsewhere) < n_behind:
                threshold = max(threshold, cfg.busy_hang_s)
                if longest < threshold:
                    return []
            ranks, hosts, nodes = self._who(culprits)
            op = next((c.get("op") for c, _ in at_s if c.get("op")), None)
            ev = {"pg": group.name, "seq": s, "op": op, "reason": "behind",
                  "waiting_ranks": n_at, "longest_wait_s": round(longest, 3),
                  "threshold_s": round(threshold, 3), "behind_ranks": n_behind,
                  "enqueued": {str(r): c["enqueued"] for c in behind for r in c["ranks"]},
                  "waiting_elsewhere": elsewhere, "summarised": True}
            more = f" (+{n_behind - len(culprits)} more)" if n_behind > len(culprits) else ""
            return [(("hang", group.name, s, ranks), Finding(
                FindingKind.HANG, ranks, hosts, nodes, ev,
                f"hang: rank(s) {_fmt(ranks)}{more} on {_fmt(hosts)} never entered op {s} "
                f"of group {group.name} that {n_at} rank(s) wait in ({longest:.1f} s)"))]
        if members < group.size or group.size < 2:
            return []
        if any(c["completed"] >= s for c, _ in classes):
            return []
        if any(c["completed"] + 1 != s or c.get("waiting", 0) < c["count"]
               or c["waiting_min_s"] + age < threshold for c, age in classes):
            return []
        shortest = min(c["waiting_min_s"] + age for c, age in classes)
        hosts = tuple(sorted({self._ranks[r].host for rs in self._node_ranks.values()
                              for r in rs if r in self._ranks}))
        nodes = tuple(sorted({n for n in self._node_ranks}))
        listed = sorted(r for c, _ in classes for r in c["ranks"])
        op = next((c.get("op") for c, _ in classes if c.get("op")), None)
        ev = {"pg": group.name, "seq": s, "op": op, "shortest_wait_s": round(shortest, 3),
              "threshold_s": round(threshold, 3), "hosts": list(hosts[:64]),
              "members": members, "summarised": True}
        return [(("comm_hang", group.name, s), Finding(
            FindingKind.COMM_HANG, tuple(listed), hosts, nodes, ev,
            f"comm_hang: all {members} ranks of group {group.name} entered op {s} and none "
            f"finished it in {shortest:.1f} s; hosts {_fmt(hosts[:8])}"
            f"{' ...' if len(hosts) > 8 else ''}"))]

    def _minority(self, group: _Group, waiting: list[int], behind: list[int]) -> list[int]:
        if len(behind) < len(waiting):
            return behind
        if len(behind) > len(waiting):
            return []
        # A tie (two ranks, or two equal camps): the camp that waits in a less busy group
        # for the others is the culprit, as a rank stuck in a side group's collective is.
        mine = max((m.completed for m in group.members.values()), default=-1)
        for r in behind:
            elsewhere = [self._groups[name] for name, m in self._ranks[r].groups.items()
                         if name != group.name and m.waiting_s is not None]
            if not any(max((m.completed for m in g.members.values()), default=-1) < mine
                       for g in elsewhere):
                return []
        return behind

    def _complete_ops(self, group: _Group) -> range:
        """The kept seqs that every member completed, oldest first (unlisted ones: all < 1
        interval)."""
        if len(group.members) < group.size:
            return range(0)
        done = min(m.completed for m in group.members.values())
        keep = self.config.window * self.config.history
        return range(max(group.start, done - keep + 1, 0), done + 1)

    def _durations(self, group: _Group, seq: int) -> dict[int, float]:
        listed = group.ops.get(seq, {})
        return {r: listed.get(r, 0.0) for r in group.members}

    def _spread(self, group: _Group, seq: int) -> tuple[float, float]:
        """(min, max) duration of op ``seq`` over the members, without building the row."""
        listed = group.ops.get(seq)
        if not listed:
            return 0.0, 0.0
        values = [v for r, v in listed.items() if r in group.members]
        lo = min(values) if len(values) == len(group.members) else 0.0
        return lo, max(values, default=0.0)

    def _slow_pass(self, group: _Group) -> list[tuple[tuple, Finding]] | None:
        """slow_rank / slow_comm over the last ``window`` ops; None: nothing new to look at."""
        cfg = self.config
        seqs = self._complete_ops(group)
        if not seqs or seqs[-1] == group.slow_seen:
            return None
        group.slow_seen = seqs[-1]
        if len(group.members) < 2:
            return []
        interval = group.interval_s
        found: list[tuple[tuple, Finding]] = []
        floor = max(cfg.slow_min_s, 2 * interval)
        spreads = [self._spread(group, s) for s in seqs]
        # An op tells who arrived last only when someone waited at least the floor longer
        # than the last arrival: a step has one such op (the first collective after the
        # slow rank's compute) among several that all enter together (DDP's later buckets).
        informative = [(s, lo) for s, (lo, hi) in zip(seqs, spreads, strict=True)
                       if hi - lo >= floor]
        recent = [(s, self._durations(group, s), lo) for s, lo in informative[-cfg.window:]]
        slow_rank = None
        if len(recent) >= cfg.min_ops:
            # Each op's waiting (longest minus shortest duration) is blamed on its last
            # arrival; an op whose last arrival is a tie blames nobody but still counts.
            last_count: dict[int, int] = {}
            blame: dict[int, float] = {}
            waiting = 0.0
            for _, d, lo in recent:
                wait = max(d.values()) - lo
                waiting += wait
                tied = [r for r, v in d.items() if v <= lo + interval / 2]
                if len(tied) == 1:
                    last_count[tied[0]] = last_count.get(tied[0], 0) + 1
                    blame[tied[0]] = blame.get(tied[0], 0.0) + wait
            if blame and waiting > 0:
                cand = max(blame, key=blame.__getitem__)
                share = blame[cand] / waiting
                late_c: list[float] = []
                late_o: dict[int, list[float]] = {}
                for _, d, _lo in recent:
                    vals = sorted(d.values())
                    med_all = median(vals)
                    others = [v for r, v in d.items() if r != cand]
                    late_c.append(median(others) - d[cand])
                    for r, v in d.items():
                        if r != cand:
                            late_o.setdefault(r, []).append(med_all - v)
                lat = median(late_c)
                other_lat = [median(v) for v in late_o.values()]
                centre = median(other_lat)
                spread = max(1.4826 * _mad(other_lat, centre), interval)
                z = (lat - centre) / spread
                if share >= cfg.slow_share and lat >= floor and z >= cfg.slow_z:
                    slow_rank = cand
                    ranks, hosts, nodes = self._who([cand])
                    ev = {"pg": group.name, "ops": len(recent), "last_in": last_count[cand],
                          "wait_share": round(share, 3), "lateness_s": round(lat, 4),
                          "others_lateness_s": round(centre, 4), "z": round(z, 2),
                          "floor_s": round(floor, 4),
                          "seqs": [recent[0][0], recent[-1][0]]}
                    found.append((("slow_rank", group.name, cand), Finding(
                        FindingKind.SLOW_RANK, ranks, hosts, nodes, ev,
                        f"slow_rank: rank {cand} on {_fmt(hosts)} was last in "
                        f"{last_count[cand]}/{len(recent)} ops of group {group.name}, "
                        f"{lat * 1000:.0f} ms late (median), {share:.0%} of the waiting")))
        # slow_comm: the fastest rank's duration is the communication itself.
        mins = [lo for lo, _ in spreads]
        if len(mins) >= 2 * cfg.window:
            current = median(mins[-cfg.window:])
            active = ("slow_comm", group.name) in self._active
            if group.baseline is None or not active:
                group.baseline = median(mins[-2 * cfg.window:-cfg.window])
            base = group.baseline
            comm_floor = max(cfg.comm_min_s, 2 * interval)
            if (slow_rank is None and current >= cfg.comm_factor * base
                    and current - base >= comm_floor):
                ranks, hosts, nodes = self._who(list(group.members))
                ev = {"pg": group.name, "op_s": round(current, 4), "baseline_s": round(base, 4),
                      "factor": round(current / base, 2) if base > 0 else None,
                      "ops": cfg.window, "hosts": list(hosts)}
                found.append((("slow_comm", group.name), Finding(
                    FindingKind.SLOW_COMM, ranks, hosts, nodes, ev,
                    f"slow_comm: ops of group {group.name} take {current * 1000:.0f} ms "
                    f"against a baseline of {base * 1000:.0f} ms with arrivals aligned; "
                    f"probing hosts {_fmt(hosts)}")))
        return found

    def _probe_pass(self) -> list[tuple[tuple, Finding]]:
        cfg = self.config
        cells = self._probes
        hosts = sorted({h for pair in cells for h in pair})
        found: list[tuple[tuple, Finding]] = []
        if len(hosts) < 2:
            return found
        slow_hosts: set[str] = set()
        if len(hosts) >= 3:
            for h in hosts:
                rest = [c["mb_s"] for (a, b), c in cells.items() if h not in (a, b)]
                if not rest:
                    continue
                ref = median(rest)
                row = [c["mb_s"] for (a, _), c in cells.items() if a == h]
                col = [c["mb_s"] for (_, b), c in cells.items() if b == h]
                bad = [name for name, v in (("row", row), ("column", col))
                       if len(v) >= 2 and median(v) < cfg.probe_frac * ref]
                if bad and ref > 0:
                    slow_hosts.add(h)
                    node = self._host_node.get(h, h)
                    ev = {"host": h, "slow": bad, "reference_mb_s": round(ref, 2),
                          "row_mb_s": {b: round(c["mb_s"], 2) for (a, b), c in cells.items()
                                       if a == h},
                          "column_mb_s": {a: round(c["mb_s"], 2) for (a, b), c in cells.items()
                                          if b == h}}
                    found.append((("slow_host", h), Finding(
                        FindingKind.SLOW_HOST, (), (h,), (node,), ev,
                        f"slow_host: probes {' and '.join(bad)} of host {h} median below "
                        f"{cfg.probe_frac:.2f} x {ref:.0f} MB/s")))
        ref_all = median(c["mb_s"] for c in cells.values())
        for (a, b), c in sorted(cells.items()):
            if a in slow_hosts or b in slow_hosts:
                continue
            if c["mb_s"] < cfg.probe_frac * ref_all:
                link = tuple(sorted((a, b)))
                key = ("slow_link",) + link
                if any(k == key for k, _ in found):
                    continue
                nodes = tuple(self._host_node.get(h, h) for h in link)
                ev = {"link": list(link), "mb_s": round(c["mb_s"], 2), "rtt_s": c["rtt_s"],
                      "error": c["error"], "reference_mb_s": round(ref_all, 2)}
                found.append((key, Finding(
                    FindingKind.SLOW_LINK, (), link, nodes, ev,
                    f"slow_link: {a} -> {b} measured {c['mb_s']:.0f} MB/s against a median "
                    f"of {ref_all:.0f} MB/s" + (f" ({c['error']})" if c["error"] else ""))))
        return found

    # ------------------------------------------------------------ out
    def _add_plan(self, finding: Finding) -> None:
        hosts = list(finding.hosts)
        count = 0
        for i, a in enumerate(hosts):
            for b in hosts[i + 1:]:
                if count >= self.config.max_probe_pairs:
                    return
                count += 1
                for src, dst in ((a, b), (b, a)):
                    if (src, dst) in self._planned:
                        continue
                    self._planned.add((src, dst))
                    node = self._host_node.get(src, src)
                    self._plan.setdefault(node, []).append(
                        {"node_id": self._host_node.get(dst, dst), "host": dst})

    def probe_plan(self) -> dict[str, list[dict]]:
        """Probes to order, new since the last call: node_id -> [{"node_id", "host"}] peers.

        Both directions of every host pair of a comm_hang or slow_comm group (at most
        ``max_probe_pairs`` pairs per finding), so that rows and columns can be told apart.
        """
        plan, self._plan = self._plan, {}
        return plan

    def suspects(self) -> list[Finding]:
        return list(self._active.values())

    def status(self) -> dict:
        """Suspects with their evidence and the probe matrix: JSON-serialisable."""
        return {
            "restart": self.generation,
            "world": self.world,
            "ranks": len(self._ranks),
            "groups": len(self._groups),
            "summaries": self.summaries,
            "suspects": [f.to_dict() for f in self._active.values()],
            "probes": [{"src": a, "dst": b, "mb_s": c["mb_s"], "rtt_s": c["rtt_s"],
                        "error": c["error"]} for (a, b), c in sorted(self._probes.items())],
        }


def _fmt(items: tuple) -> str:
    return ",".join(str(i) for i in items)
