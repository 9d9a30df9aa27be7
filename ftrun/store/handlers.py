"""The store's handler table: one method per message kind a rank (or a tool) sends it.

Each handler answers from the store's parts (verifier, commit mirror, persist writer,
catalog) and returns the reply's kind and body; the store's server runs them one at a time
between the loop's own work.
"""

from __future__ import annotations

import logging
from typing import Any

from ftrun import protocol
from ftrun.errors import FtrunError, ProtocolError, UnreachableError
from ftrun.protocol.transport import Client
from ftrun.snapshot.api import SegmentState
from ftrun.store.api import ClaimAnswer, StoreConfig
from ftrun.store.catalog import Catalog
from ftrun.store.commits import COORDINATOR_TIMEOUT_S, CommitMirror
from ftrun.store.persist_writer import PersistWriter
from ftrun.store.verifier import Verifier

log = logging.getLogger("ftrun.store")

Reply = tuple[str, dict[str, Any]] | None


class StoreHandlers:
    """What the store answers to each request kind."""

    def __init__(self, cfg: StoreConfig, catalog: Catalog, commits: CommitMirror,
                 verifier: Verifier, persister: PersistWriter, coord: Client | None) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self._commits = commits
        self._verifier = verifier
        self._persist = persister
        self._coord = coord
        self.cadence: dict[int, tuple[int, int]] = {}  # rank -> (snapshots skipped, interval)
        self.replication: Any = None  # ftrun.store.replica.Replication, once started
        self.shards: Any = None  # ftrun.store.shards.ShardService, once started

    def handle(self, msg: protocol.Message) -> Reply:
        """Answer one request from a rank: what the server's handler table runs."""
        handler = self.table().get(msg.kind)
        if handler is None:
            raise ProtocolError(f"the store does not accept {msg.kind!r}")
        return handler(msg)

    def table(self) -> dict[str, Any]:
        return {
            "snap_staged": self._on_staged,
            "snap_claim": self._on_claim,
            "snap_flush": self._on_flush,
            "snap_restored": self._on_restored,
            "store_persist": self._on_persist,
            "catalog_request": self._on_catalog,
            "fault_corrupt": self._on_fault_corrupt,
            "stores_request": self._on_stores,
        }

    def _follow_ranks(self, b: dict[str, Any]) -> None:
        if b["epoch"] != self._commits.epoch and "base" in b:
            self._commits.follow_epoch(b["epoch"], b["base"])

    def _on_staged(self, msg: protocol.Message) -> Reply:
        b = msg.body
        self._follow_ranks(b)
        if "every" in b:
            self.cadence[b["rank"]] = (b.get("skipped", 0), b["every"])
        name = self.catalog.buffer_name(b["rank"], b["buffer"])
        ok, reason, _ = self._verifier.verify_staged(name, b["step"])
        if not ok:
            log.error("rank %d step %d not verified: %s", b["rank"], b["step"], reason)
        body = {"rank": b["rank"], "buffer": b["buffer"], "step": b["step"], "ok": ok,
                "committed": self._commits.committed}
        if reason:
            body["reason"] = reason[:1000]
        return "snap_done", body

    def _on_claim(self, msg: protocol.Message) -> Reply:
        b = msg.body
        self._follow_ranks(b)
        # Everything staged is verified first: a claim must never race the hashing.
        self._verifier.verify_rank(b["rank"])
        if self._persist.pinned_buffer(self.catalog.buffer_name(b["rank"], b["buffer"])):
            # It holds a persist target still being copied out: not now (the rank skips
            # this snapshot; it never waits).
            return "snap_claim_reply", {"ok": False, "committed": self._commits.committed}
        which = self._commits.claim(b["epoch"], b["need_committed"])
        reply = {"ok": which is not None, "committed": self._commits.committed}
        if which == ClaimAnswer.NEWEST:
            reply["buffer"] = 1 - b["buffer"]
        return "snap_claim_reply", reply

    def _on_flush(self, msg: protocol.Message) -> Reply:
        b = msg.body
        self._verifier.verify_rank(b["rank"])
        return "ack", {"re": msg.id}

    def _on_restored(self, msg: protocol.Message) -> Reply:
        b = msg.body
        commits = self._commits
        if b["epoch"] != commits.epoch:
            commits.begin_epoch(b["epoch"], b["step"], restarted=False)
            commits.world_size = b["world_size"]
            commits.source = b.get("source") or ""
            commits.ask("snap_epoch", commits.epoch_body(b["epoch"], b["step"]))
        return "ack", {"re": msg.id}

    def _on_persist(self, msg: protocol.Message) -> Reply:
        b = msg.body
        self._commits.request_persist(b["reason"])
        return "ack", {"re": msg.id}

    def _on_catalog(self, msg: protocol.Message) -> Reply:
        b = msg.body
        records = self.catalog.records(b.get("rank"))
        if b.get("replicas") and self.replication is not None:
            records += [r for r in self.replication.receiver.records()
                        if b.get("rank") is None or r.rank == b["rank"]]
        return "catalog_reply", {"node_id": self.cfg.node_id, "records": [
            r.to_json(with_hashes=bool(b.get("hashes"))) for r in records]}

    def _on_stores(self, msg: protocol.Message) -> Reply:
        """The job's live stores' shard services, as the coordinator knows them (this store's
        own at least): where a restoring rank looks for shards (ftrun.store.shards)."""
        stores: dict[str, str] = {}
        if self._coord is not None:
            try:
                reply = self._coord.request("stores_request", {}, "stores_reply",
                                            COORDINATOR_TIMEOUT_S)
                stores = {s["node_id"]: s["addr"] for s in reply.body["stores"]}
            except (UnreachableError, FtrunError) as e:
                log.warning("coordinator did not list the job's stores (%s): a restore reads "
                            "this node's shards only", e)
        if self.shards is not None:
            stores[self.cfg.node_id] = self.shards.address
        return "stores_reply", {"stores": [{"node_id": n, "addr": a}
                                           for n, a in sorted(stores.items())]}

    def _on_fault_corrupt(self, msg: protocol.Message) -> Reply:
        b = msg.body
        return "fault_reply", self._corrupt(b["rank"])

    def _corrupt(self, rank: int) -> dict[str, Any]:
        """Fault injection: flip one byte in the middle of ``rank``'s newest verified shard,
        leaving its state and hashes as they are (silent corruption)."""
        shards = [r for r in self.catalog.records(rank) if r.state == SegmentState.VERIFIED]
        if not shards:
            raise FtrunError(f"this store holds no verified shard of rank {rank} to corrupt; "
                             "retry once a snapshot of it has been verified")
        newest = max(shards, key=lambda r: r.step)
        seg = self.catalog.open(newest.segment)
        assert seg is not None
        h = seg.header()
        offset = h.data_len // 2
        seg.mm[h.data_off + offset] ^= 0xFF
        log.warning("fault injection: flipped byte %d of rank %d's shard of step %d (%s)",
                    offset, rank, h.step, newest.segment)
        return {"segment": newest.segment, "step": h.step, "offset": offset}
