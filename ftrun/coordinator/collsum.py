"""Collective reports reduced on the way: what a launcher, and a group's aggregator, send the
detection service instead of every rank's ``coll_report`` once a job is large.

At 16,384 nodes x 8 ranks, every rank's report twice a second would be 262,144 messages a
second at the coordinator. What the hang analysis needs from them is small: per process
group, which sequence numbers the ranks have enqueued and completed, who waits and for how
long, who fell silent. Ranks in the same state are counted together as one *class* (the same
last enqueued and completed sequence numbers): in steady state a group has one or two
classes per launcher, and a hang shows as a large class waiting at op ``s`` and a small one
(the culprit) that never enqueued it. So:

- a launcher's :class:`Collector` takes its own ranks' reports (they report to the launcher,
  ``FTRUN_DETECT``) and makes one ``coll_summary`` of them every :data:`QUIET_SUMMARY_S`,
  or every :data:`SUMMARY_S` while one of its ranks has waited :data:`URGENT_WAIT_S` in a
  collective or fallen silent (a hang in the making: the analysis names one after 3 s);
- a group's aggregator (:mod:`ftrun.coordinator.aggregation`) merges its members' summaries
  with its own (:func:`merge`) and sends one per group to the detection service;
- the detection service (:mod:`ftrun.coordinator.detect`, ``Detector.add_summary``) merges
  the groups' summaries per process group and applies the same hang rules as to single
  reports: a minority that never entered the op the others wait in, silent ranks while
  others wait, every rank in an op nobody finished.

Class sizes are exact; the ranks of a class are listed up to :data:`CLASS_RANKS` (the
culprits of a hang form a small class and are always listed). Waits travel as durations
(each hop adds the time a summary waited before it was merged), never clock readings.

Small jobs are unchanged: below ``FTRUN_COLL_SUMMARY_RANKS`` ranks a launcher forwards each
report as it came, and the per-rank analysis (slow ranks and slow links included) runs on
them. Summaries carry no per-rank durations, so ``slow_rank`` and ``slow_comm`` are not
derived from them: at that scale the probes (``slow_host``/``slow_link``) and the hang rules
remain.
"""

from __future__ import annotations

from typing import Any

SUMMARY_S = 0.25          # a launcher's (and an aggregator's) summary period while urgent
QUIET_SUMMARY_S = 1.0     # ... and while no rank waits long or falls silent
URGENT_WAIT_S = 0.5       # a wait this long makes summaries urgent
CLASS_RANKS = 8           # ranks listed per class
SILENT_REPORT_S = 1.5     # a rank whose last report is this old is listed as silent
STALE_S = 2.0             # a member's summary older than this is left out of its group's
ROSTER_EVERY = 20         # the roster goes with every this many summaries (and on change)
MAX_RETIRED = 16


def _pending(g: dict[str, Any]) -> bool:
    return g.get("waiting_s") is not None


class Collector:
    """One launcher's ranks' latest reports, summarised on demand (no I/O, no threads)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.world: str | None = None
        self.restart = -1
        self._retired: list[str] = []
        self._latest: dict[int, tuple[dict[str, Any], float]] = {}  # rank -> (report, at)
        self._ops: dict[str, dict[int, float]] = {}  # pg -> seq -> longest duration
        self._sizes: dict[str, int] = {}
        self.interval_s = 0.02
        self._roster_sent: tuple = ()
        self._seq = 0

    def _new_world(self, world: str | None, restart: int) -> None:
        if self.world is not None and self.world != world:
            self._retired = [*self._retired[-(MAX_RETIRED - 1):], self.world]
        self.world, self.restart = world, restart
        self._latest.clear()
        self._ops.clear()
        self._sizes.clear()

    def add_report(self, body: dict[str, Any], now: float) -> bool:
        """One rank's ``coll_report`` (as a dict); False when it belongs to an older world."""
        world = body.get("world")
        restart = int(body.get("restart", 0))
        if world is not None and world in self._retired:
            return False
        if world != self.world or (world is None and restart > self.restart):
            if world is None and restart < self.restart:
                return False
            self._new_world(world, restart)
        rank = int(body["rank"])
        old = self._latest.get(rank)
        if old is not None and body["seq"] <= old[0]["seq"] and body.get("pid") == \
                old[0].get("pid"):
            return False
        self._latest[rank] = (body, now)
        self.interval_s = float(body.get("interval_s", self.interval_s))
        for g in body["groups"]:
            self._sizes[g["pg"]] = int(g["size"])
            done = g.get("done")
            if done:
                ops = self._ops.setdefault(g["pg"], {})
                for entry in done:
                    if len(entry) == 2 and isinstance(entry[0], int) \
                            and isinstance(entry[1], (int, float)):
                        seq, duration = entry
                        if duration > ops.get(seq, -1.0):
                            ops[seq] = float(duration)
        return True

    def summary(self, now: float) -> dict[str, Any] | None:
        """The ``coll_summary`` body of what arrived (None: no report of this world yet);
        the ops gathered so far go with it and are not sent again."""
        if not self._latest:
            return None
        groups: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
        members: dict[str, int] = {}
        silent: list[list[Any]] = []
        left: list[int] = []
        roster: list[list[Any]] = []
        for rank in sorted(self._latest):
            body, at = self._latest[rank]
            age = now - at
            roster.append([rank, body["node_id"], body["host"]])
            if body.get("leaving"):
                left.append(rank)
            elif age >= SILENT_REPORT_S:
                silent.append([rank, round(age, 3)])
            waits = {g["pg"]: g for g in body["groups"] if _pending(g)}
            for g in body["groups"]:
                pg = g["pg"]
                members[pg] = members.get(pg, 0) + 1
                key = (int(g["enqueued"]), int(g["completed"]))
                c = groups.setdefault(pg, {}).get(key)
                if c is None:
                    c = groups[pg][key] = {"enqueued": key[0], "completed": key[1], "count": 0,
                                           "ranks": [], "waiting": 0}
                c["count"] += 1
                if len(c["ranks"]) < CLASS_RANKS:
                    c["ranks"].append(rank)
                    for other, og in waits.items():
                        if other != pg:
                            c.setdefault("elsewhere", []).append(
                                [rank, other, int(og["completed"]) + 1,
                                 round(og["waiting_s"] + age, 4)])
                if _pending(g):
                    wait = round(g["waiting_s"] + age, 4)
                    c["waiting"] += 1
                    c["waiting_min_s"] = min(c.get("waiting_min_s", wait), wait)
                    c["waiting_max_s"] = max(c.get("waiting_max_s", wait), wait)
                    if g.get("op") and "op" not in c:
                        c["op"] = g["op"]
        out_groups = []
        for pg, classes in groups.items():
            entry: dict[str, Any] = {"pg": pg, "size": self._sizes.get(pg, 0),
                                     "members": members[pg], "classes": list(classes.values())}
            ops = self._ops.get(pg)
            if ops:
                entry["ops"] = [[s, d] for s, d in sorted(ops.items())]
            out_groups.append(entry)
        self._ops.clear()
        self._seq += 1
        body = {"node_id": self.node_id, "nodes": [self.node_id],
                "restart": self.restart, "interval_s": self.interval_s, "seq": self._seq,
                "groups": out_groups}
        if self.world is not None:
            body["world"] = self.world
        key = tuple(map(tuple, roster))
        if key != self._roster_sent or self._seq % ROSTER_EVERY == 1:
            body["roster"] = roster
            self._roster_sent = key
        if silent:
            body["silent"] = silent
        if left:
            body["left"] = left
        return body

    def urgent(self, now: float) -> bool:
        """Whether a rank waits :data:`URGENT_WAIT_S` in a collective or has gone quiet."""
        for body, at in self._latest.values():
            if body.get("leaving"):
                continue
            age = now - at
            if age >= SILENT_REPORT_S:
                return True
            for g in body["groups"]:
                if _pending(g) and g["waiting_s"] + age >= URGENT_WAIT_S:
                    return True
        return False


def urgent(summary: dict[str, Any]) -> bool:
    """Whether ``summary`` shows a long wait or a silent rank (see :meth:`Collector.urgent`)."""
    if summary.get("silent"):
        return True
    return any((c.get("waiting_max_s") or 0.0) >= URGENT_WAIT_S
               for g in summary["groups"] for c in g["classes"])


def age(summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``summary`` as it reads ``seconds`` later: waits and silences grown by that much."""
    if seconds <= 0:
        return summary
    out = dict(summary)
    groups = []
    for g in summary["groups"]:
        classes = []
        for c in g["classes"]:
            if c.get("waiting"):
                c = {**c, "waiting_min_s": round(c["waiting_min_s"] + seconds, 4),
                     "waiting_max_s": round(c["waiting_max_s"] + seconds, 4)}
            if c.get("elsewhere"):
                c = {**c, "elsewhere": [[r, pg, s, round(w + seconds, 4)]
                                        for r, pg, s, w in c["elsewhere"]]}
            classes.append(c)
        groups.append({**g, "classes": classes})
    out["groups"] = groups
    if summary.get("silent"):
        out["silent"] = [[r, round(a + seconds, 3)] for r, a in summary["silent"]]
    return out


def merge(node_id: str, seq: int, summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One summary of several launchers' (already aged to now; see :func:`age`; the
    sender's own first), sent by ``node_id``: classes of the same process group and state
    add up; the rosters that came go on. Summaries of another world than the newest
    restart's are left out."""
    if not summaries:
        return None
    newest = max(s["restart"] for s in summaries)
    worlds = [s.get("world") for s in summaries if s["restart"] == newest]
    # While a new world forms, launchers' summaries name either: the sender's own (the first
    # summary) wins, else the one most of them name (world names have no order).
    world = worlds[0] if summaries[0]["restart"] == newest else \
        max(set(worlds), key=worlds.count)
    keep = [s for s in summaries if s["restart"] == newest and s.get("world") == world]
    groups: dict[str, dict[str, Any]] = {}
    nodes: list[str] = []
    silent: list[list[Any]] = []
    left: list[int] = []
    ranks: list[list[Any]] = []
    for s in keep:
        nodes += s["nodes"]
        silent += s.get("silent") or []
        left += s.get("left") or []
        ranks += s.get("roster") or []
        for g in s["groups"]:
            into = groups.get(g["pg"])
            if into is None:
                into = groups[g["pg"]] = {"pg": g["pg"], "size": g["size"], "members": 0,
                                          "classes": {}, "ops": {}}
            into["members"] += g["members"]
            into["size"] = max(into["size"], g["size"])
            for seq, duration in g.get("ops") or ():
                if duration > into["ops"].get(seq, -1.0):
                    into["ops"][seq] = duration
            for c in g["classes"]:
                key = (c["enqueued"], c["completed"])
                have = into["classes"].get(key)
                if have is None:
                    into["classes"][key] = {**c, "ranks": list(c["ranks"]),
                                            **({"elsewhere": list(c["elsewhere"])}
                                               if c.get("elsewhere") else {})}
                    continue
                have["count"] += c["count"]
                listed = sorted(have["ranks"] + c["ranks"])[:CLASS_RANKS]
                have["ranks"] = listed
                if c.get("elsewhere"):
                    have["elsewhere"] = [e for e in have.get("elsewhere", []) + c["elsewhere"]
                                         if e[0] in listed]
                elif have.get("elsewhere"):
                    have["elsewhere"] = [e for e in have["elsewhere"] if e[0] in listed]
                if c.get("waiting"):
                    have["waiting"] = have.get("waiting", 0) + c["waiting"]
                    for k, pick in (("waiting_min_s", min), ("waiting_max_s", max)):
                        have[k] = pick(have[k], c[k]) if have.get(k) is not None else c[k]
                if c.get("op") and not have.get("op"):
                    have["op"] = c["op"]
    out_groups = []
    for g in groups.values():
        entry = {"pg": g["pg"], "size": g["size"], "members": g["members"],
                 "classes": list(g["classes"].values())}
        if g["ops"]:
            entry["ops"] = [[s, d] for s, d in sorted(g["ops"].items())]
        out_groups.append(entry)
    body: dict[str, Any] = {"node_id": node_id, "nodes": nodes, "restart": newest,
                            "interval_s": max(s["interval_s"] for s in keep), "seq": seq,
                            "groups": out_groups}
    if world is not None:
        body["world"] = world
    if ranks:
        body["roster"] = ranks
    if silent:
        body["silent"] = silent
    if left:
        body["left"] = left
    return body
