"""The coordinator's part of the snapshot data plane: commits, persist targets, replicas.

Stores report here (``snap_epoch``, ``snap_verified``, ``commit_query``,
``persist_request``, ``store_report``, ``replica_verified``, ``stores_request``); the
decisions themselves are :class:`ftrun.coordinator.commits.CommitTracker`'s. This part keeps
what each store last reported, answers with commit information and replica plans, and
summarises it all for the status document. Thread-safe (its own lock; it asks the
membership whether a node is gone, never the other way round).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ftrun import protocol
from ftrun.coordinator.commits import CommitTracker, StoreState
from ftrun.coordinator.corruption import CorruptionPolicy
from ftrun.coordinator.events import EventLog
from ftrun.coordinator.membership import Membership
from ftrun.coordinator.placement import group_placement
from ftrun.protocol.transport import Reply

log = logging.getLogger(__name__)


class SnapshotControl:
    """Commits and replicas of the job's snapshots, as the stores report them."""

    def __init__(self, membership: Membership, events: EventLog,
                 corruption: CorruptionPolicy | None = None) -> None:
        self._membership = membership
        self._events = events
        self._corruption = corruption  # acts on replicas that disagree (--on-corruption)
        self._lock = threading.Lock()
        self._commits = CommitTracker(
            node_gone=lambda node: self._gone(node, time.monotonic()))
        self._store_reports: dict[str, dict[str, Any]] = {}
        self._store_seen: dict[str, float] = {}  # node -> monotonic time of its last report
        self._finalizing: set[str] = set()  # nodes whose store asked for its final target

    def handlers(self) -> dict[str, Any]:
        """kind -> handler, for the coordinator's handler table."""
        return {
            "snap_epoch": self._on_commit,
            "snap_verified": self._on_commit,
            "commit_query": self._on_commit,
            "persist_request": self._on_commit,
            "store_report": self._on_store_report,
            "replica_verified": self._on_replica_verified,
            "replica_dropped": self._on_replica_dropped,
            "stores_request": self._on_stores,
        }

    def counts_of(self, node_id: str) -> dict[str, Any]:
        """What a node's store last reported of its ranks' snapshots over the job: how many
        they skipped, and the most time one of them was held by snapshots ({}: no report)."""
        with self._lock:
            report = self._store_reports.get(node_id)
        if report is None:
            return {}
        out: dict[str, Any] = {"snapshots_skipped": int(report.get("skipped") or 0)}
        if report.get("blocked_s") is not None:
            out["snapshot_blocked_s"] = float(report["blocked_s"])
        if report.get("skip_reasons"):
            out["snapshot_skip_reasons"] = dict(report["skip_reasons"])
        return out

    def _gone(self, node_id: str, mono: float) -> bool:
        return self._membership.gone(node_id, mono)

    def _on_commit(self, msg: protocol.Message) -> Reply:
        return Reply("commit_info", self._commit(msg.kind, msg.body))

    def _on_store_report(self, msg: protocol.Message) -> Reply:
        body = msg.body
        with self._lock:
            self._store_reports[body["node_id"]] = dict(body)
            self._commits.persisted[body["node_id"]] = body["persisted_step"]
            self._commits.stores[body["node_id"]] = StoreState(
                bool(body.get("persist")), body.get("epoch"),
                body.get("target_done", -1), body.get("writing"))
            self._store_seen[body["node_id"]] = time.monotonic()
            if body.get("replicas", 1) > 1 and body.get("replica_addr"):
                self._commits.replicas = body["replicas"]
                return Reply("replica_plan", self._replica_plan(body["node_id"]))
        return Reply("ack", {"re": msg.id})

    def _on_stores(self, msg: protocol.Message) -> Reply:
        """The shard services of the live stores (ftrun.store.shards): where a restore
        looks for the shards its node does not hold."""
        mono = time.monotonic()
        with self._lock:
            stores = [{"node_id": node, "addr": r["shard_addr"]}
                      for node, r in sorted(self._store_reports.items())
                      if r.get("shard_addr") and not r.get("final")
                      and not self._gone(node, mono)]
        return Reply("stores_reply", {"stores": stores})

    # -- replicas (ftrun.store.replica) ----------------------------------------------------

    def _replica_members(self) -> dict[str, str]:
        """node -> replica address, for the live stores that take replicas. Caller holds
        the lock."""
        mono = time.monotonic()
        return {
            node: r["replica_addr"] for node, r in self._store_reports.items()
            if r.get("replica_addr") and not r.get("final") and not self._gone(node, mono)
            and mono - self._store_seen.get(node, 0.0) <= self._membership.node_timeout_s
        }

    def _placement(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Group placement over the live stores (recomputed from the membership each time).
        Caller holds the lock."""
        members = self._replica_members()
        # Fewer live members than m: fewer replicas can exist, and durable counts those.
        self._commits.set_replica_nodes(len(members))
        return group_placement(sorted(members), self._commits.replicas), members

    def _replica_plan(self, node_id: str) -> dict[str, Any]:
        placement, members = self._placement()
        peers = [{"node_id": p, "addr": members[p]} for p in placement.get(node_id, [])]
        plan: dict[str, Any] = {"replicas": self._commits.replicas, "members": len(members),
                                "peers": peers}
        off = self._commits.durable_off()
        if off:
            plan["off"] = off  # the store says once that it replicates nothing, and why
        return plan

    def _on_replica_verified(self, msg: protocol.Message) -> Reply:
        b = msg.body
        with self._lock:
            ep = self._commits.get(b["epoch"])
            before = ep.durable if ep is not None else -1
            ep = self._commits.replica_verified(b["epoch"], b["node_id"], b["origin"],
                                                b["rank"], b["step"])
            durable = ep.durable if ep is not None else -1
        if durable > before:
            log.debug("step %d is durable (every shard has %d verified replica(s))", durable,
                      self._commits.replicas - 1)
        return Reply("ack", {"re": msg.id})

    def _on_replica_dropped(self, msg: protocol.Message) -> Reply:
        b = msg.body
        with self._lock:
            self._commits.replica_dropped(b["epoch"], b["node_id"], b["rank"], b["step"])
        return Reply("ack", {"re": msg.id})

    def _commit(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if kind == "persist_request" and body["final"]:
                self._finalizing.add(body["node_id"])
            reply, began = self._commits.handle(kind, body)
            if reply.get("known") and self._commits.replicas > 1 and \
                    len(self._replica_members()) > 1:
                ep = self._commits.get(reply["epoch"])
                reply["durable"] = ep.durable if ep is not None else -1
            targets, self._commits.new_targets = self._commits.new_targets, []
            skipped, self._commits.skipped = self._commits.skipped, []
            diverged, self._commits.sdc.found = self._commits.sdc.found, []
            committed = self._commits.commit_batch.drain()
        if committed is not None:
            self._events.record("snapshots_committed", None, committed)
        for d in diverged:
            if self._corruption is not None:
                self._corruption.handle(d)
        if began is not None and began.pop("retaught", False):
            # Not a restore: a store taught this (restarted or new) coordinator the epoch.
            self._events.record("epoch_retaught", body["node_id"], began)
        elif began is not None:
            self._events.record("restore", body["node_id"], began)
        for step, writing in skipped:
            log.warning("step %d is due for disk but node(s) %s still write the previous "
                        "target: skipped, the next commit after that write is due instead",
                        step, ", ".join(writing))
            self._events.record("persist_skipped", body.get("node_id"),
                         {"step": step, "writing": writing})
        for t in targets:
            log.info("persist target: step %d of epoch %s (%s%s)", t.step, t.epoch, t.reason,
                     ", final" if t.final else "")
            self._events.record("persist_target", body.get("node_id"),
                         {"epoch": t.epoch, "step": t.step, "reason": t.reason,
                          "final": t.final})
        return reply

    def flush_commits(self) -> None:
        """Record the commits not in a ``snapshots_committed`` event yet (the coordinator
        calls it before a failure, a recovery or the end is recorded, and as it stops)."""
        with self._lock:
            committed = self._commits.commit_batch.drain(force=True)
        if committed is not None:
            self._events.record("snapshots_committed", None, committed)

    def wait_final_persists(self, timeout_s: float, start_grace_s: float,
                            exclude: str | None = None) -> list[str]:
        """Wait until every node whose store persists has written its final step, left, or
        gone silent. Returns the nodes given up on.

        A node whose store has asked for the final target is waited for up to ``timeout_s``
        in all; one that has not asked yet only up to ``start_grace_s`` (it may not be
        stopping at all). The launcher that runs the coordinator calls this before stopping
        it: the other nodes' stores ask it which step to write as they stop.
        """
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            with self._lock:
                waiting = [
                    node for node, r in self._store_reports.items()
                    if node != exclude and r.get("persist") and not r.get("final")
                    and not self._gone(node, now)
                ]
                started = [n for n in waiting if n in self._finalizing]
            if not waiting or now - t0 >= timeout_s or (
                    not started and now - t0 >= start_grace_s):
                return waiting
            time.sleep(0.1)

    def summary(self) -> dict[str, Any] | None:
        with self._lock:
            summary = self._commits.summary()
            stores = {n: {"bytes": r["bytes"], "segments": r["segments"],
                          "persisted_step": r["persisted_step"], "ranks": r["ranks"],
                          "skipped": r.get("skipped", 0), "every": r.get("every")}
                      for n, r in self._store_reports.items()}
        if summary is None and not stores:
            return None
        out: dict[str, Any] = dict(summary or {})
        out["stores"] = stores
        # Snapshots the ranks gave up (the store had not released a buffer in time), and the
        # interval they snapshot at (the largest any node reports).
        out["skipped"] = sum(s["skipped"] for s in stores.values())
        reasons: dict[str, int] = {}
        with self._lock:
            for r in self._store_reports.values():
                for reason, n in (r.get("skip_reasons") or {}).items():
                    reasons[reason] = reasons.get(reason, 0) + int(n)
        if reasons:
            out["skip_reasons"] = reasons
        out["every"] = max((s["every"] for s in stores.values() if s["every"]), default=None)
        with self._lock:
            if self._commits.replicas > 1:
                out["replica_coverage"] = self._replica_coverage()
            out.update(self._parity())
            if self._corruption is not None:
                out["corruption"] = self._corruption.status(self._commits.sdc)
        return out

    def _parity(self) -> dict[str, Any]:
        """With erasure coding (--redundancy ec:K+M): the code, the newest step whose parity
        the whole placement holds, and per node the newest step whose parity it built and
        the bytes of its fragments and rebuilt shards. Caller holds the lock."""
        codes = {r["redundancy"] for r in self._store_reports.values() if r.get("redundancy")}
        if not codes:
            return {}
        durable = max((r.get("parity_durable", -1) for r in self._store_reports.values()),
                      default=-1)
        return {"redundancy": sorted(codes)[0], "parity_durable_step":
                durable if durable > 0 else None,
                "parity": {node: {"built_step": r.get("parity_step", -1),
                                  "durable_step": r.get("parity_durable", -1),
                                  "parity_bytes": r.get("parity_bytes", 0),
                                  "rebuilt_bytes": r.get("rebuilt_bytes", 0)}
                           for node, r in sorted(self._store_reports.items())
                           if r.get("redundancy")}}

    def _replica_coverage(self) -> dict[str, dict[str, Any]]:
        """Per node: the peers holding its replicas, and the newest step whose shards of its
        ranks all have m - 1 verified replicas. Caller holds the lock."""
        placement, _ = self._placement()
        return {
            node: {"peers": placement.get(node, []),
                   "replicated_step": self._commits.covered(list(r.get("ranks") or [])),
                   "sent": r.get("replica_sent", 0), "superseded": r.get("replica_superseded", 0),
                   "abandoned": r.get("replica_abandoned", 0),
                   # why this node's store last refused to hold a peer's replica (full /dev/shm)
                   "refused": r.get("replica_refused")}
            for node, r in sorted(self._store_reports.items())
        }
