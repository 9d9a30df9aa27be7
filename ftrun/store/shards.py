"""Shards served across nodes: what each store holds, and byte ranges of it, to any rank.

A restore after a lost node, or onto another number of ranks, needs shards that are not in
its own node's memory: the lost node's ranks' shards live on as replicas in its peers' stores
(ftrun.store.replica), and a rank of a resharded job reads parts of several old ranks'
shards. Two halves:

- :class:`ShardService` runs in every node's store, on a thread of its own and a TCP socket
  on the node's replica/rendezvous interface. It lists the verified shards the node holds
  (its own ranks' and the replicas of peers' ranks: ``holdings_request``) and serves a
  shard's manifest and chunk hash table (``shard_meta_request``) and its chunks
  (``shard_read_request``). It serves only segments it lists, reads each chunk between two
  looks at the segment header (a rank rewriting the buffer is refused, never served torn),
  and never blocks the store's message loop.
- The ranks' half (ftrun.rank.shards) surveys the live stores and reads shards from them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ftrun import protocol
from ftrun.errors import FtrunError, IntegrityError
from ftrun.protocol import messages as m
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Reply, Server
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.api import SegmentState
from ftrun.snapshot.manifest import parse_manifest
from ftrun.store.catalog import Catalog, Record

log = logging.getLogger("ftrun.shards")

SERVE_POLL_S = 0.1


class ShardService:
    """Serves this node's verified shards (own and replicas) on a TCP socket (one thread).

    ``replicas()`` lists the replica records the node's receiver holds (verified ones carry
    their hashes); the node's own segments are found through a catalog of this thread's own.
    """

    def __init__(self, run_id: str, node_id: str, owner_pid: int, secret: bytes,
                 replicas: Callable[[], list[Record]] | None = None,
                 refused: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.node_id = node_id
        self.catalog = Catalog(run_id, node_id, owner_pid)
        self._replicas = replicas
        self._refused = refused  # the rebuilds this node refused (erasure coding)
        self._world: dict[tuple[str, int, str, int], int] = {}  # (segment, step, epoch, manifest hash)
        self._service = Service(Server("shard service", secret, run_id, {
            "holdings_request": self._on_holdings,
            "shard_meta_request": self._on_meta,
            "shard_read_request": self._on_read,
        }, sender=f"shards:{node_id}", typed=True), poll_s=SERVE_POLL_S, max_messages=16,
            thread_name="ftrun-shards")
        self.address = ""

    def start(self, host: str) -> str:
        self.address = self._service.bind_tcp(host)
        self._service.start()
        log.info("serving this node's shards on %s", self.address)
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        self._service.stop(timeout_s)
        self.catalog.close()

    # -- what is held ---------------------------------------------------------------------
    def _held(self) -> dict[str, Record]:
        records = [r for r in self.catalog.records() if r.state == SegmentState.VERIFIED and r.hashes]
        if self._replicas is not None:
            records += [r for r in self._replicas() if r.state == SegmentState.VERIFIED and r.hashes]
        return {r.segment: r for r in records}

    def _world_size(self, seg: shm.Segment, h: shm.Header) -> int | None:
        key = (seg.name, h.step, h.epoch, h.manifest_xxh3)
        if key not in self._world:
            try:
                self._world[key] = int(parse_manifest(seg.manifest_bytes(h))["world_size"])
            except (FtrunError, KeyError, TypeError, ValueError) as e:
                log.warning("segment %s: unreadable manifest (%s); not offered", seg.name, e)
                return None
            if len(self._world) > 4096:
                self._world.pop(next(iter(self._world)))
        return self._world[key]

    def _segment(self, rec: Record, step: int, epoch: str) -> tuple[shm.Segment, shm.Header]:
        seg = self.catalog.open(rec.segment)
        if seg is None:
            raise FtrunError(f"segment {rec.segment} is gone")
        h = seg.header()
        if (h.state, h.step, h.epoch) != (shm.VERIFIED, step, epoch):
            raise FtrunError(f"{rec.segment} now holds step {h.step} ({h.state_name}), not "
                             f"step {step}")
        return seg, h

    def _on_holdings(self, msg: protocol.Message) -> m.HoldingsReply:
        out = []
        for rec in self._held().values():
            seg = self.catalog.open(rec.segment)
            if seg is None:
                continue
            try:
                h = seg.header()
                world = self._world_size(seg, h)
            except IntegrityError:
                continue
            if world is None or (h.step, h.epoch) != (rec.step, rec.epoch):
                continue
            out.append({"segment": rec.segment, "origin": rec.origin, "rank": rec.rank,
                        "step": rec.step, "epoch": rec.epoch, "world_size": world,
                        "data_len": rec.data_len, "chunk_size": rec.chunk_size})
        if self._refused is not None:
            return m.HoldingsReply(node_id=self.node_id, records=out, refused=self._refused())
        return m.HoldingsReply(node_id=self.node_id, records=out)

    def _record(self, b: m.ShardMetaRequest | m.ShardReadRequest) -> Record:
        rec = self._held().get(b.segment)
        if rec is None or (rec.step, rec.epoch) != (b.step, b.epoch):
            raise FtrunError(f"this node holds no verified {b.segment} of step {b.step}")
        return rec

    def _on_meta(self, msg: protocol.Message) -> Reply:
        b: m.ShardMetaRequest = msg.body
        rec = self._record(b)
        seg, h = self._segment(rec, b.step, b.epoch)
        manifest, hashes = seg.manifest_bytes(h), seg.hashes(h)
        if seg.header() != h:
            raise FtrunError(f"{rec.segment} changed while it was read")
        return Reply("shard_meta", m.ShardMeta(data_len=h.data_len, chunk_size=h.chunk_size),
                     [manifest, verify.pack_hashes(hashes)])

    def _on_read(self, msg: protocol.Message) -> Reply:
        b: m.ShardReadRequest = msg.body
        rec = self._record(b)
        seg, h = self._segment(rec, b.step, b.epoch)
        ranges = verify.chunk_ranges(h.data_len, h.chunk_size)
        first, count = b.first, b.count
        if not (first >= 0 and 0 < count <= verify.READ_CHUNKS_MAX and first + count <= len(ranges)):
            raise FtrunError(f"chunks {first}..{first + count - 1} of {len(ranges)} (at most "
                             f"{verify.READ_CHUNKS_MAX} per request)")
        data = seg.data(h)
        frames = [bytes(data[lo:hi]) for lo, hi in ranges[first:first + count]]
        if seg.header() != h:
            raise FtrunError(f"{rec.segment} changed while it was read")
        return Reply("shard_data", m.ShardData(first=first, count=count), frames)
