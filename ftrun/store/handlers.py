"""The store's handler table: one method per message kind a rank (or a tool) sends it.

Each handler takes the request's typed body (ftrun.protocol.messages) and answers from the
store's parts (verifier, commit mirror, persist writer, catalog) with the reply's typed body;
the store's server runs them one at a time between the loop's own work.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from ftrun import protocol
from ftrun.errors import FtrunError, ProtocolError, UnreachableError
from ftrun.protocol import messages as m
from ftrun.protocol.messages import UNSET, Body, given
from ftrun.protocol.transport import Client, Reply
from ftrun.snapshot.api import SegmentState
from ftrun.store.api import ClaimAnswer, StoreConfig
from ftrun.store.catalog import Catalog
from ftrun.store.commits import COORDINATOR_TIMEOUT_S, CommitMirror
from ftrun.store.persist_writer import PersistWriter
from ftrun.store.verifier import Verifier

log = logging.getLogger("ftrun.store")




class RankTally:
    """A running total each rank's snapshots carry (the snapshots it skipped, the time they
    held its training thread), over the job: a rank's total starts over with each Snapshotter
    (a restarted rank, in place or in a new process). A snapshot of another Snapshotter than
    the last one seen (``counts``, its identity), or without one a value lower than the last,
    adds the last value to the rank's earlier total."""

    def __init__(self) -> None:
        self._before: dict[int, float] = {}  # rank -> the totals of its earlier Snapshotters
        self._last: dict[int, float] = {}  # rank -> the value its newest snapshot carried
        self._owner: dict[int, str | None] = {}  # rank -> the Snapshotter it came from

    def add(self, rank: int, value: float, counts: str | None = None) -> float:
        """Take a snapshot's value; returns the rank's total over the job."""
        last = self._last.get(rank, 0)
        owner = self._owner.get(rank)
        if (counts != owner) if counts is not None and owner is not None else value < last:
            self._before[rank] = self._before.get(rank, 0) + last
        self._last[rank], self._owner[rank] = value, counts
        return self._before.get(rank, 0) + value

    def totals(self) -> dict[int, float]:
        return {r: self._before.get(r, 0) + v for r, v in self._last.items()}


class ReasonTally:
    """The snapshots each rank skipped over the job, by reason, from the counts by reason its
    snapshots carry (a :class:`RankTally` per reason; a reason a new Snapshotter has not
    counted yet is 0 for it)."""

    def __init__(self) -> None:
        self._tallies: dict[str, RankTally] = {}
        self._known: dict[int, set[str]] = {}  # rank -> the reasons it ever counted

    def add(self, rank: int, counts: dict[str, int], owner: str | None = None) -> None:
        known = self._known.setdefault(rank, set())
        known |= set(counts)
        for reason in known:
            self._tallies.setdefault(reason, RankTally()).add(rank, counts.get(reason, 0),
                                                              owner)

    def totals(self) -> dict[str, int]:
        """Skips by reason, all ranks together."""
        return {reason: int(sum(t.totals().values())) for reason, t in self._tallies.items()}

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
        self._skips = RankTally()
        self.blocked = RankTally()  # seconds snapshots held each rank's training thread
        self.skip_reasons = ReasonTally()  # the ranks' skips over the job, by reason
        self.replication: Any = None  # ftrun.store.replica.Replication, once started
        self.shards: Any = None  # ftrun.store.shards.ShardService, once started
        self.surveyor: Any = None  # ftrun.store.survey.Surveyor

    def handle(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        """Answer one request as the store's server does, outside it (tests, tools): a plain
        body is decoded to its kind's typed body first; the answer comes as (kind, plain
        body)."""
        handler = self.table().get(msg.kind)
        if handler is None:
            raise ProtocolError(f"the store does not accept {msg.kind!r}")
        if not isinstance(msg.body, Body):
            try:
                body = msgspec.convert(msg.body, protocol.BODIES[msg.kind])
            except msgspec.ValidationError as e:
                raise ProtocolError(f"{msg.kind} body: {e}") from e
            msg = msgspec.structs.replace(msg, body=body)
        answer = handler(msg)
        if isinstance(answer, Reply):
            return answer.kind, dict(answer.body)
        return None if answer is None else (answer.KIND, m.to_dict(answer))

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
            "survey_request": self._on_survey,
        }

    def _follow_ranks(self, b: m.SnapStaged | m.SnapClaim) -> None:
        if b.epoch != self._commits.epoch and b.base is not UNSET:
            self._commits.follow_epoch(b.epoch, b.base)

    def _on_staged(self, msg: protocol.Message) -> m.SnapDone:
        b: m.SnapStaged = msg.body
        self._follow_ranks(b)
        if b.every is not UNSET:
            owner = given(b.counts, None)
            self.cadence[b.rank] = (int(self._skips.add(b.rank, given(b.skipped, 0), owner)),
                                    b.every)
            if b.blocked_s is not UNSET:
                self.blocked.add(b.rank, b.blocked_s, owner)
            if b.skip_reasons is not UNSET:
                self.skip_reasons.add(b.rank, b.skip_reasons, owner)
        name = self.catalog.buffer_name(b.rank, b.buffer)
        ok, reason, _ = self._verifier.verify_staged(name, b.step)
        if not ok:
            log.error("rank %d step %d not verified: %s", b.rank, b.step, reason)
        return m.SnapDone(rank=b.rank, buffer=b.buffer, step=b.step, ok=ok,
                          committed=self._commits.committed,
                          reason=reason[:1000] if reason else UNSET)

    def _on_claim(self, msg: protocol.Message) -> m.SnapClaimReply:
        b: m.SnapClaim = msg.body
        self._follow_ranks(b)
        # Everything staged is verified first: a claim must never race the hashing.
        self._verifier.verify_rank(b.rank)
        if self._persist.pinned_buffer(self.catalog.buffer_name(b.rank, b.buffer)):
            # It holds a persist target still being copied out: not now (the rank skips
            # this snapshot; it never waits).
            return m.SnapClaimReply(ok=False, committed=self._commits.committed)
        which = self._commits.claim(b.epoch, b.need_committed)
        return m.SnapClaimReply(ok=which is not None, committed=self._commits.committed,
                                buffer=1 - b.buffer if which == ClaimAnswer.NEWEST else UNSET)

    def _on_flush(self, msg: protocol.Message) -> m.Ack:
        b: m.SnapFlush = msg.body
        self._verifier.verify_rank(b.rank)
        self._commits.refresh()  # a restore follows: learn the steps replicas disagreed on
        return m.Ack(re=msg.id)

    def _on_restored(self, msg: protocol.Message) -> m.Ack:
        b: m.SnapRestored = msg.body
        commits = self._commits
        if b.epoch != commits.epoch:
            commits.begin_epoch(b.epoch, b.step, restarted=False)
            commits.world_size = b.world_size
            commits.source = given(b.source, "")
            commits.ask("snap_epoch", commits.epoch_body(b.epoch, b.step))
        return m.Ack(re=msg.id)

    def _on_persist(self, msg: protocol.Message) -> m.Ack:
        b: m.StorePersist = msg.body
        self._commits.request_persist(b.reason)
        return m.Ack(re=msg.id)

    def _on_catalog(self, msg: protocol.Message) -> Reply:
        b: m.CatalogRequest = msg.body
        rank = given(b.rank, None)
        records = self.catalog.records(rank)
        if given(b.replicas, False) and self.replication is not None:
            records += [r for r in self.replication.receiver.records()
                        if rank is None or r.rank == rank]
        with_hashes = given(b.hashes, False)
        # Plain: the records' states are enum members, which only the encoder turns into
        # JSON (a typed body takes free-form fields as JSON already).
        return Reply("catalog_reply", {"node_id": self.cfg.node_id, "records": [
            r.to_json(with_hashes=with_hashes) for r in records],
            "committed": self._commits.committed, "durable": self._commits.durable_step(),
            "replicating": self._commits.replication is not None or self._commits.erasure})

    def _on_stores(self, msg: protocol.Message) -> m.StoresReply:
        """The job's live stores' shard services, as the coordinator knows them (this store's
        own at least): where a restoring rank looks for shards (ftrun.store.shards)."""
        return m.StoresReply(stores=[m.Peer(node_id=n, addr=a)
                                     for n, a in sorted(self.job_stores().items())])

    def job_stores(self) -> dict[str, str]:
        """node -> shard service of the job's live stores, as the coordinator lists them, with
        this store's own (when it serves shards)."""
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
        return stores

    def _on_survey(self, msg: protocol.Message) -> m.SurveyReply:
        """Every verified shard the job's live stores hold, surveyed once per restore for
        all of this node's ranks (ftrun.store.survey)."""
        b: m.SurveyRequest = msg.body
        if self.surveyor is None:
            raise FtrunError("this store does not survey the job's stores")
        return self.surveyor.answer(b.key, max(0, given(b.offset, 0)))

    def _on_fault_corrupt(self, msg: protocol.Message) -> m.FaultReply:
        b: m.FaultCorrupt = msg.body
        return self._corrupt(b.rank)

    def _corrupt(self, rank: int) -> m.FaultReply:
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
        return m.FaultReply(segment=newest.segment, step=h.step, offset=offset)
