"""Erasure-coded snapshots between stores (``--redundancy ec:K+M``): parity built store to
store off the training path, and a lost node's shards rebuilt from its group's survivors.

The coding itself is :mod:`ftrun.store.erasure`; who holds what is
:func:`ftrun.coordinator.placement.erasure_placement`, computed by every store from the same
sorted list of the job's live stores (the coordinator's ``stores_request``). Everything here
runs on threads of the store process, never in a training process and never on the store's
message loop, and every byte it moves goes through the stores' shard services
(:mod:`ftrun.store.shards`: ``shard_meta_request`` / ``shard_read_request``), so no new
message kind is needed:

- **parity** (:class:`ErasureCoding`, one thread): for the newest committed step, each store
  builds the parity fragments its placement gives it: for each of its stripes and each local
  shard index ``i`` (the ``i``-th rank of every node, by rank), it reads slice ``j`` of the
  ``i``-th shard of each of the stripe's ``K`` data nodes (chunks ``j, j+K, ...``) from their
  shard services, each chunk checked against the shard's chunk hashes by the encoder, codes
  the ``M`` fragments and keeps its own. A fragment is a shared-memory segment like a
  replica's (header, manifest, chunk hashes, bytes), named ``<job>.ec-<holder>-p-...``; its
  manifest records the stripe (the code, the slices' lengths, the chunk hashes of every
  position) and, for every data position, the shard's node, rank, length, manifest and chunk
  hashes, so that the survivors can rebuild a lost node's shard from the fragments alone.
  The shard service lists fragments with rank ``-1`` (restores skip them) and serves them as
  any shard. A step is **durable** under erasure coding once every stripe's ``M`` fragments
  are held, verified, by their holders (each store checks the whole placement after building
  its own); the store then keeps that step's rank buffers as it keeps a replicated durable
  step (:mod:`ftrun.store.commits`), so the data slices a rebuild needs stay in memory. A
  build that cannot be had (a data node gone, a chunk that does not verify) is logged and
  tried again at the next committed step; the ranks never wait for it.
- **rebuild** (:meth:`ErasureCoding.rebuild_lost`, on the store's survey thread, once per
  restore: :mod:`ftrun.store.survey`): the fragments listed by the live stores name their
  placement; nodes of it that no longer answer are lost. For the newest step whose fragments
  are held, each lost node's shards are rebuilt once, by the first live node of its group
  (sorted), slice by slice from ``K`` verified pieces of each stripe (the survivors' data
  slices and the fragments), checked chunk by chunk against the hashes the fragments
  recorded and, whole, against the shard's own hash table, and kept in a segment of that
  store listed as a shard of the lost node: the restore reads it as it reads a replica. The
  other stores' surveys wait for it (bounded) and list it. Fewer than ``K`` verified pieces:
  the rebuild is refused with the reason, the step is not complete in memory, and the
  restore falls back (an older step, the disk).

Limits of this version: a store restarted by its launcher does not adopt the fragments its
predecessor built (it removes them, and builds the next step's); parity is built by pulling
the data slices (each holder reads about one node's worth of bytes per fragment), not by
partial encodes along a chain.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ftrun import protocol
from ftrun.coordinator.placement import ErasurePlacement, Stripe, erasure_placement
from ftrun.errors import ConfigError, FtrunError, IntegrityError, RestoreError
from ftrun.protocol.transport import Client, RateLimiter
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.api import SegmentState
from ftrun.snapshot.manifest import MANIFEST_VERSION, parse_manifest
from ftrun.store.catalog import Record, node_tag
from ftrun.store.erasure import (
    Codec,
    Encoder,
    StripeInfo,
    join_slices,
    rebuild,
    slice_hashes,
    slice_lengths,
)
from ftrun.store.survey import ask_holdings

log = logging.getLogger("ftrun.store.ec")

PARITY_RANK = -1  # the rank a fragment is listed with: no restore takes it for a shard
POLL_S = 0.25
READ_TIMEOUT_S = 20.0
COORDINATOR_TIMEOUT_S = 5.0
WARN_EVERY_S = 30.0
# A store that does not rebuild a lost node's shards itself waits this long at most for the
# store that does (it rebuilds them in its own survey, once its ranks restore: about when
# this one's do); then the step is not complete in memory and the restore falls back.
REBUILD_WAIT_S = 30.0
REBUILD_POLL_S = 0.2
MAX_REFUSED = 64  # refused rebuilds a store remembers (newest kept)
_PARITY_RE = re.compile(r"-p-([0-9a-f]{8})-g(\d+)-t(\d+)-i(\d+)-s(\d+)$")


def ec_prefix(run_id: str) -> str:
    """Every erasure-coding segment of the job on this host starts with this (not with the
    job prefix: nothing that lists a node's own rank buffers sees them)."""
    return shm.job_prefix(run_id)[:-1] + ".ec-"


def nodes_digest(nodes: Sequence[str]) -> str:
    """A short digest of a placement's node list: fragments of one placement share it."""
    return hashlib.sha1("\n".join(sorted(nodes)).encode()).hexdigest()[:8]


def parity_name(run_id: str, holder: str, digest: str, stripe: int, t: int, index: int,
                slot: int) -> str:
    return (f"{ec_prefix(run_id)}{node_tag(holder)}-p-{digest}-g{stripe}-t{t}-i{index}"
            f"-s{slot}")


def rebuilt_name(run_id: str, holder: str, origin: str, rank: int) -> str:
    return f"{ec_prefix(run_id)}{node_tag(holder)}-b-{node_tag(origin)}-r{rank}"


@dataclass(frozen=True)
class FragmentKey:
    """What a fragment's name says: its placement (digest), stripe, parity index, local shard
    index and slot."""

    digest: str
    stripe: int
    t: int
    index: int
    slot: int

    @classmethod
    def of(cls, name: str) -> FragmentKey | None:
        found = _PARITY_RE.search(name)
        if found is None:
            return None
        d, g, t, i, s = found.groups()
        return cls(d, int(g), int(t), int(i), int(s))


def parity_length(lengths: Sequence[int], chunk_size: int) -> int:
    """Bytes of every parity fragment of data slices of ``lengths``."""
    chunks = max((shm.chunk_count(n, chunk_size) for n in lengths), default=0)
    if chunks == 0:
        return 0
    last = max(max(0, min(chunk_size, n - (chunks - 1) * chunk_size)) for n in lengths)
    return (chunks - 1) * chunk_size + last


# -- reading shards and fragments from the stores' shard services ------------------------------


@dataclass(frozen=True)
class ShardMeta:
    manifest: bytes
    hashes: list[int]
    data_len: int
    chunk_size: int


class _Reader:
    """Reads shards (and fragments) from the stores' shard services; every chunk checked
    against the hash table its holder gave (the callers check those tables in turn)."""

    def __init__(self, secret: bytes, run_id: str, sender: str) -> None:
        self._secret, self._run_id, self._sender = secret, run_id, sender
        self._clients: dict[str, Client] = {}

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def _client(self, addr: str) -> Client:
        if addr not in self._clients:
            self._clients[addr] = Client(addr, self._secret, self._run_id, self._sender,
                                         peer="snapshot store",
                                         max_frame_bytes=protocol.MAX_FRAME_BYTES)
        return self._clients[addr]

    def meta(self, rec: dict[str, Any]) -> ShardMeta:
        reply = self._client(rec["addr"]).request(
            "shard_meta_request", {"segment": rec["segment"], "step": rec["step"],
                                   "epoch": rec["epoch"]}, "shard_meta", READ_TIMEOUT_S)
        if len(reply.frames) != 2:
            raise IntegrityError(f"shard_meta with {len(reply.frames)} frames")
        meta = ShardMeta(bytes(reply.frames[0]), verify.unpack_hashes(reply.frames[1]),
                         int(reply.body["data_len"]), int(reply.body["chunk_size"]))
        if len(meta.hashes) != shm.chunk_count(meta.data_len, meta.chunk_size):
            raise IntegrityError(f"{rec['segment']} on node {rec['node']}: "
                                 f"{len(meta.hashes)} chunk hashes for {meta.data_len} bytes")
        return meta

    def chunk(self, rec: dict[str, Any], meta: ShardMeta, i: int, check: bool = True) -> bytes:
        """Chunk ``i`` of a shard, checked against ``meta``'s hash table (``check``: False
        when the caller checks it against a table of its own, as the encoder and the
        rebuild do: one pass of hashing, not two)."""
        reply = self._client(rec["addr"]).request(
            "shard_read_request", {"segment": rec["segment"], "step": rec["step"],
                                   "epoch": rec["epoch"], "first": i, "count": 1},
            "shard_data", READ_TIMEOUT_S)
        if len(reply.frames) != 1:
            raise IntegrityError(f"shard_data with {len(reply.frames)} frames for one chunk")
        blob = bytes(reply.frames[0])
        lo, hi = verify.chunk_ranges(meta.data_len, meta.chunk_size)[i]
        if len(blob) != hi - lo or (check and xxhash.xxh3_64_intdigest(blob) != meta.hashes[i]):
            raise IntegrityError(f"{rec['segment']} on node {rec['node']}: chunk {i} does not "
                                 "match its hash")
        return blob

    def column(self, rec: dict[str, Any], meta: ShardMeta, first: int, step: int) -> list[bytes]:
        """Chunks ``first, first + step, ...`` of a shard (a slice; ``step`` 1: all), for
        :func:`ftrun.store.erasure.rebuild`, which checks every piece it uses."""
        n = len(meta.hashes)
        return [self.chunk(rec, meta, i, check=False) for i in range(first, n, step)]


# -- segments this store holds for erasure coding --------------------------------------------------


@dataclass
class _Held:
    seg: shm.Segment
    record: Record


class EcSegments:
    """The fragments and rebuilt shards this store holds (thread-safe): listed to the shard
    service as records, removed at the store's end."""

    def __init__(self, run_id: str, node_id: str, owner_pid: int) -> None:
        self.run_id, self.node_id, self.owner_pid = run_id, node_id, owner_pid
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}

    def records(self) -> list[Record]:
        with self._lock:
            return [h.record for h in self._held.values()]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def nbytes(self, rebuilt: bool | None = None) -> int:
        """Shared memory held (``rebuilt``: only rebuilt shards, or only fragments)."""
        with self._lock:
            return sum(len(h.seg.mm) for h in self._held.values()
                       if rebuilt is None or (h.record.rank != PARITY_RANK) == rebuilt)

    def write(self, name: str, *, origin: str, rank: int, step: int, epoch: str,
              manifest: bytes, hashes: list[int], data: Sequence[bytes | bytearray | memoryview],
              n_tensors: int, chunk_size: int) -> Record:
        """A new VERIFIED segment ``name`` (replacing any of that name) holding ``data``
        (its pieces in order), listed from now on."""
        self.drop(name)
        data_len = sum(memoryview(d).nbytes for d in data)
        seg = shm.Segment.create(name, manifest_cap=len(manifest) + 4096, n_tensors=n_tensors,
                                 data_len=data_len, owner_pid=self.owner_pid,
                                 chunk_size=chunk_size)
        try:
            seg.set_state(shm.WRITING, step=step, epoch=epoch, data_len=data_len,
                          n_tensors=n_tensors, manifest_len=0, manifest_xxh3=0, hashes_xxh3=0,
                          staged_at=0.0)
            h = seg.header()
            at = h.data_off
            for d in data:
                v = memoryview(d).cast("B")
                seg.mm[at:at + v.nbytes] = v
                at += v.nbytes
            bad = verify.bad_chunks(seg.data(), chunk_size, hashes)
            if bad:
                raise IntegrityError(f"{name}: chunk(s) {bad[:8]} do not match their hashes "
                                     "once written")
            xm = seg.write_manifest(manifest)
            seg.set_state(shm.WRITING, manifest_len=len(manifest), manifest_xxh3=xm)
            xh = seg.write_hashes(hashes)
            seg.set_state(shm.VERIFIED, hashes_xxh3=xh, staged_at=time.time())
        except Exception:
            seg.unlink()
            raise
        record = Record(name, rank, -1, origin, step, epoch, SegmentState.VERIFIED, data_len,
                        chunk_size, list(hashes))
        with self._lock:
            self._held[name] = _Held(seg, record)
        return record

    def drop(self, name: str) -> None:
        with self._lock:
            held = self._held.pop(name, None)
        if held is not None:
            held.seg.unlink()
        else:
            try:
                (shm.SHM_DIR / name).unlink()
            except FileNotFoundError:
                pass

    def drop_where(self, keep: Callable[[Record], bool]) -> int:
        gone = [r.segment for r in self.records() if not keep(r)]
        for name in gone:
            self.drop(name)
        return len(gone)

    def close(self, unlink: bool) -> None:
        with self._lock:
            held, self._held = self._held, {}
        for h in held.values():
            if unlink:
                h.seg.unlink()
            else:
                h.seg.close()


# -- the store's erasure coding ----------------------------------------------------------------


def _own_shards(records: list[dict[str, Any]], node: str, epoch: str,
                step: int) -> list[dict[str, Any]]:
    """``node``'s own verified shards of ``step`` as its store listed them, by rank."""
    return sorted((r for r in records if r["node"] == node and r["origin"] == node
                   and r["rank"] >= 0 and r["step"] == step and r["epoch"] == epoch),
                  key=lambda r: r["rank"])


class ErasureCoding:
    """A store's side of ``ec:K+M``: builds its parity fragments of each committed step on a
    thread of its own, tells ``durable(step)`` once the whole placement holds the step's
    parity, and rebuilds lost nodes' shards for a restore (:meth:`rebuild_lost`)."""

    def __init__(self, k: int, m: int, run_id: str, node_id: str, owner_pid: int,
                 secret: bytes, committed: Callable[[], tuple[str, int]],
                 coordinator: str, term: int = 0,
                 durable: Callable[[int], None] | None = None,
                 off: Callable[[], None] | None = None) -> None:
        if k < 2 or m < 1:
            raise ConfigError(f"ec:{k}+{m}: erasure coding needs K >= 2 and M >= 1")
        self.k, self.m = k, m
        self.run_id, self.node_id = run_id, node_id
        self._secret = secret
        self._committed = committed
        self._durable = durable
        # called when no parity can be built in an epoch that has had none durable (too few
        # nodes hold its steps): the store then stops keeping the ranks' buffers for it
        self._off = off
        self._coord = Client(coordinator, secret, run_id, f"ec:{node_id}", peer="coordinator",
                             term=term)
        self._coord_lock = threading.Lock()
        self.segments = EcSegments(run_id, node_id, owner_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-ec-parity", daemon=True)
        self._warn = RateLimiter(WARN_EVERY_S)
        self.built: tuple[str, int] = ("", -1)  # (epoch, step) whose own fragments are built
        self.durable_step = -1  # newest step whose parity the whole placement holds
        self.durable_epoch = ""  # the snapshot epoch of durable_step
        self.failed = 0  # builds given up (logged)
        self.off: str | None = None  # why no parity is built now
        # (lost node, step, epoch) -> why: the rebuilds this store was to make and refused
        # (listed in its holdings, so that the stores waiting for them stop at once).
        self._refused: dict[tuple[str, int, str], str] = {}
        self._refused_lock = threading.Lock()  # the survey's thread writes, the shards' reads

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.remove_leftovers()
        self._thread.start()

    def remove_leftovers(self) -> int:
        """Remove the fragments and rebuilt shards a previous store of this node left (it
        crashed and its launcher started this one): they are not listed (this store builds
        the next step's parity) and, outside the job prefix, nothing else would free their
        memory before the job ends. Returns how many."""
        mine = set(self.segments.names())
        gone = 0
        for path in shm.list_segments(f"{ec_prefix(self.run_id)}{node_tag(self.node_id)}-"):
            if path.name not in mine:
                path.unlink(missing_ok=True)
                gone += 1
        if gone:
            log.info("erasure coding: removed %d segment(s) a previous store of this node left "
                     "(their parity is built again from the next committed step)", gone)
        return gone

    def stop(self, unlink: bool, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._coord_lock:
            self._coord.close()
        self.segments.close(unlink)

    def retarget(self, coordinator: str, term: int) -> None:
        with self._coord_lock:
            self._coord.retarget(coordinator, term)

    def records(self) -> list[Record]:
        return self.segments.records()

    def report_fields(self) -> dict[str, Any]:
        return {"redundancy": f"ec:{self.k}+{self.m}", "parity_step": self.built[1],
                "parity_durable": self.durable_step,
                "parity_bytes": self.segments.nbytes(rebuilt=False),
                "rebuilt_bytes": self.segments.nbytes(rebuilt=True)}

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.work()
            except Exception as e:  # noqa: BLE001 - logged; the next round tries again
                allowed, suppressed = self._warn.allow("work")
                if allowed:
                    log.exception("erasure coding: %s%s", e,
                                  f" ({suppressed} more failures)" if suppressed else "")

    def _stores(self) -> dict[str, str]:
        with self._coord_lock:
            reply = self._coord.request("stores_request", {}, "stores_reply",
                                        COORDINATOR_TIMEOUT_S)
        return {s["node_id"]: s["addr"] for s in reply.body["stores"]}

    def _say_off(self, why: str | None) -> None:
        if why != self.off:
            self.off = why
            if why:
                log.warning("erasure coding (ec:%d+%d): no parity built now: %s", self.k,
                            self.m, why)
            else:
                log.info("erasure coding (ec:%d+%d): building parity", self.k, self.m)

    def work(self) -> None:
        """One round: build this store's fragments of the newest committed step when not yet
        done, else see whether the placement holds the step's parity in full.

        The placement is made of the nodes whose own shards of the step the live stores list
        (a spare's store, with no ranks, holds no data and no parity), sorted: every store
        computes the same one for a step, since the shards of a committed step stay listed
        until a newer step is durable."""
        epoch, step = self._committed()
        if not epoch or step <= 0 or (self.built == (epoch, step) and (
                self.durable_epoch, self.durable_step) == (epoch, step)):
            return
        stores = self._stores()
        records, lost = ask_holdings(stores, self._secret, self.run_id, f"ec:{self.node_id}")
        holders = sorted({r["node"] for r in records
                          if r["node"] == r["origin"] and r["rank"] >= 0 and r["step"] == step
                          and r["epoch"] == epoch})
        if self.node_id not in holders:
            return  # this store's ranks have not listed the step (yet)
        if len(holders) < self.k + self.m:
            self._say_off(f"{len(holders)} node(s) hold step {step}"
                          + (f" ({', '.join(lost)} did not answer)" if lost else "")
                          + f"; ec:{self.k}+{self.m} needs {self.k + self.m}; the ranks' "
                          "snapshots no longer wait for parity")
            if self._off is not None and not lost and self.durable_epoch != epoch:
                # Too few nodes in this epoch from its start (a job shrunk below K + M):
                # nothing will be durable, the ranks need not keep buffers for it. Not when
                # a store did not answer, nor once a step of the epoch was durable: that is
                # a node being lost, and its shards are rebuilt from the durable step.
                self._off()
            return
        self._say_off(None)
        placement = erasure_placement(holders, self.k, self.m)
        if self.built != (epoch, step):
            try:
                self.build(placement, stores, records, epoch, step)
            except (FtrunError, OSError, ValueError) as e:
                self.failed += 1
                allowed, suppressed = self._warn.allow("build")
                if allowed:
                    log.warning("erasure coding: parity of step %d not built here (%s); the "
                                "next committed step is tried%s", step, e,
                                f" ({suppressed} more)" if suppressed else "")
                self.built = (epoch, step)  # not again for this step
            return
        self._check_durable(placement, records, epoch, step)

    def build(self, placement: ErasurePlacement, stores: dict[str, str],
              records: list[dict[str, Any]], epoch: str, step: int) -> None:
        """This store's fragments of ``step``: every (stripe, parity index) it holds, for
        every local shard index (``records``: the live stores' holdings)."""
        held = placement.held_by(self.node_id)
        if not held:
            self.built = (epoch, step)
            return
        group = next(g for g in placement.groups if self.node_id in g)
        own = {n: _own_shards(records, n, epoch, step) for n in group}
        width = max(len(v) for v in own.values())
        digest = nodes_digest(placement.nodes)
        codec = Codec(self.k, self.m)
        reader = _Reader(self._secret, self.run_id, f"ec:{self.node_id}")
        started = time.monotonic()
        nbytes = 0
        try:
            for stripe, t in held:
                si = placement.stripes.index(stripe)
                for i in range(width):
                    shards = [own[n][i] if i < len(own[n]) else None for n in stripe.data]
                    nbytes += self._build_one(codec, reader, placement, si, stripe, t, i,
                                              shards, digest, epoch, step)
        finally:
            reader.close()
        self.built = (epoch, step)
        log.info("erasure coding: parity of step %d built here (%d fragment(s), %.1f MB, "
                 "%.2f s)", step, len(held) * width, nbytes / 1e6, time.monotonic() - started)
        self._drop_old(digest, epoch, step)

    def _build_one(self, codec: Codec, reader: _Reader, placement: ErasurePlacement, si: int,
                   stripe: Stripe, t: int, index: int, shards: list[dict[str, Any] | None],
                   digest: str, epoch: str, step: int) -> int:
        k, m = self.k, self.m
        metas: list[ShardMeta | None] = [reader.meta(r) if r is not None else None
                                         for r in shards]
        chunk = next((x.chunk_size for x in metas if x is not None), shm.CHUNK_BYTES)
        if any(x is not None and x.chunk_size != chunk for x in metas):
            raise IntegrityError(f"stripe {si}: shards of different chunk sizes")
        lengths, tables = [], []
        for j, meta in enumerate(metas):
            if meta is None:
                lengths.append(0)
                tables.append(())
                continue
            lengths.append(slice_lengths(meta.data_len, k, chunk)[j])
            tables.append(slice_hashes(meta.hashes, k)[j])
        enc = Encoder(codec, lengths, tables, chunk)
        # row by row (chunk s of every slice, then s + 1): the encoder codes each row as soon
        # as it is complete and lets its pieces go, so about K chunks are held at a time
        rows = max((len(t) for t in tables), default=0)
        for s in range(rows):
            for j, (rec, meta) in enumerate(zip(shards, metas, strict=True)):
                if rec is not None and meta is not None and s < len(tables[j]):
                    enc.add(j, s, reader.chunk(rec, meta, j + s * k, check=False))
            if self._stop.is_set():
                raise FtrunError("the store is stopping")
        frags = enc.fragments()
        info = frags[0].info
        world = {int(parse_manifest(x.manifest)["world_size"]) for x in metas if x is not None}
        if len(world) != 1:
            raise IntegrityError(f"stripe {si}: shards of different world sizes {sorted(world)}")
        data = [None if rec is None or meta is None else {
            "node": rec["node"], "rank": rec["rank"], "data_len": meta.data_len,
            "chunk_size": meta.chunk_size, "manifest": meta.manifest.decode(),
            "manifest_xxh3": xxhash.xxh3_64_intdigest(meta.manifest), "hashes": meta.hashes,
        } for rec, meta in zip(shards, metas, strict=True)]
        doc = {"v": MANIFEST_VERSION, "step": step, "rank": PARITY_RANK,
               "world_size": world.pop(), "tensors": [],
               "ec": {"k": k, "m": m, "backend": info.backend, "unit": info.unit,
                      "chunk_size": info.chunk_size, "lengths": list(info.lengths),
                      "hashes": [list(h) for h in info.hashes], "stripe": si, "parity": t,
                      "index": index, "nodes": placement.nodes, "epoch": epoch,
                      "data": data}}
        frag = frags[t]
        name = self._slot_name(digest, si, t, index)
        self.segments.write(name, origin=self.node_id, rank=PARITY_RANK, step=step,
                            epoch=epoch, manifest=json.dumps(doc).encode(),
                            hashes=list(info.hashes[k + t]), data=[frag.data], n_tensors=0,
                            chunk_size=chunk)
        return memoryview(frag.data).nbytes

    def _slot_name(self, digest: str, si: int, t: int, index: int) -> str:
        """The slot a new fragment goes to: not the one holding the newest durable step's."""
        taken = {FragmentKey.of(r.segment): r for r in self.segments.records()
                 if r.rank == PARITY_RANK}
        for slot in (0, 1):
            key = FragmentKey(digest, si, t, index, slot)
            rec = taken.get(key)
            if rec is None or (rec.epoch, rec.step) != (self.durable_epoch, self.durable_step):
                return parity_name(self.run_id, self.node_id, digest, si, t, index, slot)
        return parity_name(self.run_id, self.node_id, digest, si, t, index, 0)

    def _drop_old(self, digest: str, epoch: str, step: int) -> None:
        """Fragments of other placements or epochs, and steps older than both the newest
        durable one and this one, are of no further use."""
        def keep(r: Record) -> bool:
            if r.rank != PARITY_RANK:
                return r.epoch == epoch  # a rebuilt shard: until the next epoch
            key = FragmentKey.of(r.segment)
            return (key is not None and key.digest == digest and r.epoch == epoch
                    and r.step in (step, self.durable_step))
        self.segments.drop_where(keep)

    def _check_durable(self, placement: ErasurePlacement, records: list[dict[str, Any]],
                       epoch: str, step: int) -> None:
        """Tell ``durable`` once every stripe's fragments of ``step`` are listed, verified,
        by their holders (``records``: the live stores' holdings)."""
        digest = nodes_digest(placement.nodes)
        have = set()
        for r in records:
            key = FragmentKey.of(r["segment"])
            if (key is not None and r["rank"] == PARITY_RANK and r["step"] == step
                    and r["epoch"] == epoch and key.digest == digest):
                have.add((r["node"], key.stripe, key.t, key.index))
        for g in placement.groups:
            width = max(len(_own_shards(records, n, epoch, step)) for n in g)
            if width == 0:
                return
            for si, stripe in enumerate(placement.stripes):
                if stripe.group != placement.groups.index(g):
                    continue
                for t, holder in enumerate(stripe.parity):
                    if any((holder, si, t, i) not in have for i in range(width)):
                        return
        self.durable_epoch, self.durable_step = epoch, step
        log.info("erasure coding: step %d is durable (every stripe's %d parity fragment(s) "
                 "held and verified)", step, self.m)
        if self._durable is not None:
            self._durable(step)
        self._drop_old(digest, epoch, step)

    # -- rebuild -------------------------------------------------------------------------
    def rebuild_lost(self, live: dict[str, str],
                     records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The shards of nodes lost from the placement of the newest step whose fragments
        the live stores hold (``live``: node -> shard service; ``records``: their holdings,
        each with the ``node`` and ``addr`` holding it), rebuilt once in the job: by the
        first live node of each lost node's group (sorted), into its store. The other stores
        wait for it (at most :data:`REBUILD_WAIT_S`) and return the rebuilt shards' records
        as that store lists them, for their survey. Logged; never raises."""
        reader = _Reader(self._secret, self.run_id, f"ec-rebuild:{self.node_id}")
        try:
            return self._rebuild(live, records, reader)
        except Exception as e:  # noqa: BLE001 - the restore goes on without it, and says so
            log.exception("erasure coding: rebuild failed: %s", e)
            return []
        finally:
            reader.close()

    def _rebuild(self, live: dict[str, str], records: list[dict[str, Any]],
                 reader: _Reader) -> list[dict[str, Any]]:
        frags: dict[tuple[int, str, str], list[tuple[FragmentKey, dict[str, Any]]]] = {}
        for r in records:
            key = FragmentKey.of(r["segment"])
            if key is not None and r["rank"] == PARITY_RANK and r["node"] in live:
                frags.setdefault((r["step"], r["epoch"], key.digest), []).append((key, r))
        tried = 0
        for (step, epoch, digest), found in sorted(frags.items(), key=lambda kv: -kv[0][0]):
            holders = {r["node"] for r in records if r["node"] == r["origin"]
                       and r["rank"] >= 0 and r["step"] == step and r["epoch"] == epoch}
            if nodes_digest(sorted(holders)) == digest:
                continue  # every node of that placement still lists its shards: none lost
            docs: dict[tuple[int, int, int], dict[str, Any]] = {}
            for key, rec in found:
                try:
                    meta = reader.meta(rec)
                    docs[(key.stripe, key.t, key.index)] = {
                        **parse_manifest(meta.manifest)["ec"], "_rec": rec, "_meta": meta}
                except (FtrunError, OSError, KeyError, ValueError) as e:
                    log.warning("erasure coding: fragment %s on node %s unusable: %s",
                                rec["segment"], rec["node"], e)
            if not docs:
                continue
            nodes = next(iter(docs.values()))["nodes"]
            lost = sorted(set(nodes) - set(live))
            if not lost:
                continue  # nothing of this placement is lost
            held = {(r["origin"], r["rank"]) for r in records
                    if r["step"] == step and r["epoch"] == epoch and r["rank"] >= 0}
            tried += 1
            ok = True
            elsewhere: list[dict[str, Any]] = []
            placement = erasure_placement(nodes, self.k, self.m)
            for node in lost:
                group = next(g for g in placement.groups if node in g)
                rebuilder = next((n for n in sorted(group) if n in live), None)
                try:
                    ranks = {int(e["rank"]) for e in self._entries(node, placement, docs).values()}
                    if all((node, r) in held for r in ranks):
                        continue  # listed already (rebuilt for an earlier survey)
                    if rebuilder is None:
                        raise RestoreError(f"no node of its group ({', '.join(group)}) is live")
                    # every store checks that enough pieces are listed before it rebuilds or
                    # waits: a step whose parity was still being built is passed over at once
                    self._check_pieces(node, placement, docs, records, live, step, epoch)
                    if rebuilder == self.node_id:
                        try:
                            self._rebuild_node(node, nodes, docs, records, held, step, epoch,
                                               reader)
                        except (FtrunError, OSError, ValueError, KeyError) as e:
                            self._refuse(node, step, epoch, str(e))
                            raise
                    else:
                        elsewhere += self._await_rebuild(node, rebuilder, live[rebuilder], ranks,
                                                         step, epoch)
                except (FtrunError, OSError, ValueError, KeyError) as e:
                    ok = False
                    log.error("erasure coding: node %s's shards of step %d cannot be rebuilt: "
                              "%s; that step is not restored from memory", node, step, e)
            if ok or tried >= 2:
                return elsewhere
        return []

    def _refuse(self, node: str, step: int, epoch: str, why: str) -> None:
        with self._refused_lock:
            self._refused[(node, step, epoch)] = why[:500]
            while len(self._refused) > MAX_REFUSED:
                self._refused.pop(next(iter(self._refused)))

    def refused_rebuilds(self) -> list[dict[str, Any]]:
        """The lost nodes' shards this store was to rebuild and could not (for its
        holdings: the stores waiting for them stop at once)."""
        with self._refused_lock:
            return [{"origin": n, "step": s, "epoch": e, "why": why}
                    for (n, s, e), why in self._refused.items()]

    def _await_rebuild(self, node: str, rebuilder: str, addr: str, ranks: set[int], step: int,
                       epoch: str) -> list[dict[str, Any]]:
        """The records of ``node``'s shards of ``step`` (``ranks``) once the store of
        ``rebuilder`` lists them as rebuilt; RestoreError as soon as it lists them as refused,
        or when it has not listed them within :data:`REBUILD_WAIT_S` (its own survey
        rebuilds them, once its ranks restore)."""
        deadline = time.monotonic() + REBUILD_WAIT_S
        while True:
            refused: list[dict[str, Any]] = []
            found, _ = ask_holdings({rebuilder: addr}, self._secret, self.run_id,
                                    f"ec-rebuild:{self.node_id}", refused=refused)
            got = [r for r in found if r["origin"] == node and r["rank"] in ranks
                   and r["step"] == step and r["epoch"] == epoch]
            if {r["rank"] for r in got} == ranks:
                log.info("erasure coding: node %s's shards of step %d rebuilt by %s", node,
                         step, rebuilder)
                return got
            why = next((r.get("why") for r in refused if r.get("origin") == node
                        and r.get("step") == step and r.get("epoch") == epoch), None)
            if why is not None:
                raise RestoreError(f"node {rebuilder}, which rebuilds them, could not: {why}")
            if time.monotonic() > deadline:
                raise RestoreError(f"node {rebuilder}, which rebuilds them, did not list them "
                                   f"within {REBUILD_WAIT_S:g} s")
            time.sleep(REBUILD_POLL_S)

    def _check_pieces(self, node: str, placement: ErasurePlacement,
                      docs: dict[tuple[int, int, int], dict[str, Any]],
                      records: list[dict[str, Any]], live: dict[str, str], step: int,
                      epoch: str) -> None:
        """RestoreError unless each stripe holding a slice of ``node``'s shards has ``K``
        pieces listed by live stores: parity fragments, and the other data nodes' shards of
        ``step`` (whether they verify is seen when they are read)."""
        held = {(r["origin"], r["rank"]) for r in records
                if r["node"] in live and r["step"] == step and r["epoch"] == epoch
                and r["rank"] >= 0}
        for index in self._entries(node, placement, docs):
            for j in range(self.k):
                stripe = placement.stripe_of(node, j)
                si = placement.stripes.index(stripe)
                parity = [docs[(si, t, index)] for t in range(self.m) if (si, t, index) in docs]
                entries = parity[0]["data"] if parity else [None] * self.k
                data = sum(1 for p, n in enumerate(stripe.data) if p != j and (
                    entries[p] is None or (n, entries[p]["rank"]) in held))
                if len(parity) + data < self.k:
                    raise RestoreError(
                        f"stripe {si} (shard index {index}) has {len(parity)} parity "
                        f"fragment(s) and {data} data slice(s) listed, of the {self.k} pieces "
                        "needed (its parity not built in full, or more nodes lost)")

    @staticmethod
    def _entries(node: str, placement: ErasurePlacement,
                 docs: dict[tuple[int, int, int], dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """``node``'s shards, by local index, as the fragments of its stripes recorded them
        (rank, length, manifest, chunk hashes); refused when two fragments disagree."""
        stripe_of = {j: placement.stripes.index(placement.stripe_of(node, j))
                     for j in range(placement.k)}
        entries: dict[int, dict[str, Any]] = {}
        for (si, _t, index), doc in docs.items():
            for j, entry in enumerate(doc["data"]):
                if entry is not None and entry["node"] == node and stripe_of.get(j) == si:
                    seen = entries.setdefault(index, entry)
                    if (seen["rank"], seen["manifest_xxh3"], seen["hashes"]) != (
                            entry["rank"], entry["manifest_xxh3"], entry["hashes"]):
                        raise IntegrityError(f"the fragments disagree on rank {entry['rank']}'s "
                                             "shard")
        if not entries:
            raise RestoreError(f"no live fragment records a shard of node {node}")
        return entries

    def _rebuild_node(self, node: str, nodes: list[str],
                      docs: dict[tuple[int, int, int], dict[str, Any]],
                      records: list[dict[str, Any]], held: set[tuple[str, int]], step: int,
                      epoch: str, reader: _Reader) -> None:
        k, m = self.k, self.m
        placement = erasure_placement(nodes, k, m)
        stripe_of = {j: placement.stripes.index(placement.stripe_of(node, j)) for j in range(k)}
        entries = self._entries(node, placement, docs)
        codec = Codec(k, m)
        for index, entry in sorted(entries.items()):
            rank = int(entry["rank"])
            if (node, rank) in held:
                continue  # held already (rebuilt by this store for an earlier survey)
            manifest = entry["manifest"].encode()
            if xxhash.xxh3_64_intdigest(manifest) != entry["manifest_xxh3"]:
                raise IntegrityError(f"rank {rank}'s manifest does not match its recorded hash")
            chunk = int(entry["chunk_size"])
            slices = []
            started = time.monotonic()
            for j in range(k):
                si = stripe_of[j]
                stripe = placement.stripes[si]
                parity = {t: docs[(si, t, index)] for t in range(m) if (si, t, index) in docs}
                if not parity:
                    raise RestoreError(f"no live parity fragment of stripe {si} (index {index})")
                infos = {}
                for d in parity.values():
                    info = StripeInfo(d["k"], d["m"], d["chunk_size"], d["unit"], d["backend"],
                                      tuple(d["lengths"]), tuple(tuple(h) for h in d["hashes"]))
                    infos[info.key()] = info
                if len(infos) != 1:
                    raise IntegrityError(f"the parity fragments of stripe {si} disagree on its "
                                         "layout and hashes")
                info = next(iter(infos.values()))
                # the rebuilt slice is checked against the stripe's hashes: they must be the
                # shard's own (its manifest's hash table, cut like its bytes)
                if (list(info.hashes[j]) != list(slice_hashes(entry["hashes"], k)[j])
                        or info.lengths[j] != slice_lengths(int(entry["data_len"]), k, chunk)[j]):
                    raise IntegrityError(f"stripe {si} records other hashes for rank {rank}'s "
                                         f"slice {j} than its shard's own")
                have: dict[int, Any] = {}
                for t, d in parity.items():
                    try:
                        have[k + t] = reader.column(d["_rec"], d["_meta"], 0, 1)
                    except (FtrunError, OSError) as e:
                        log.warning("erasure coding: parity %d of stripe %d unusable: %s", t,
                                    si, e)
                for p, peer in enumerate(stripe.data):
                    if p == j or peer == node:
                        continue
                    entry_p = next((d["data"][p] for d in parity.values()), None)
                    if entry_p is None:
                        continue  # that node had no shard of this index: zeros, known
                    rec = next((r for r in records if r["node"] == peer
                                and r["origin"] == peer and r["rank"] == entry_p["rank"]
                                and r["step"] == step and r["epoch"] == epoch), None)
                    if rec is None:
                        continue  # lost too, or no longer holds the step
                    try:
                        meta = reader.meta(rec)
                        have[p] = reader.column(rec, meta, p, k)
                    except (FtrunError, OSError) as e:
                        log.warning("erasure coding: node %s's slice %d unusable: %s", peer, p, e)
                slices.append(bytes(rebuild(codec, info, have, [j])[j]))
            data = join_slices(slices, k, chunk)  # every chunk checked as it was rebuilt
            if len(data) != entry["data_len"]:
                raise IntegrityError(f"rank {rank}'s rebuilt shard is {len(data)} bytes, its "
                                     f"table says {entry['data_len']}")
            doc = parse_manifest(manifest)
            self.segments.write(rebuilt_name(self.run_id, self.node_id, node, rank),
                                origin=node, rank=rank, step=step, epoch=epoch,
                                manifest=manifest, hashes=list(entry["hashes"]), data=[data],
                                n_tensors=len(doc.get("tensors") or []), chunk_size=chunk)
            log.warning("erasure coding: rebuilt rank %d's shard of step %d (lost node %s, "
                        "%.1f MB) from its group's parity and data, verified, in %.2f s", rank,
                        step, node, len(data) / 1e6, time.monotonic() - started)
