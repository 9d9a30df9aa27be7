"""Reading shards across nodes, rank side: what every live store holds, and one old rank's shard.

The stores' shard services (ftrun.store.shards) list what each node holds and serve byte
ranges of it; each node's store surveys what every live store holds, once per restore for all
its ranks (ftrun.store.survey: a store that does not answer is a lost node, and is left out).
Here, in the ranks, :func:`holding` reads a survey's record, :func:`complete` finds the steps whose every old rank's shard is held somewhere, and
:class:`ShardReader` reads one old rank's shard from its holders: its own node's segment
straight from shared memory, others' over the wire. Every chunk is checked against its xxh3
before it is used; a chunk that fails is read from the next holder, and the failure is logged
with the holder, chunk and tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ftrun import protocol
from ftrun.errors import FtrunError, IntegrityError
from ftrun.protocol.transport import Client
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import parse_manifest

log = logging.getLogger("ftrun.shards")

READ_TIMEOUT_S = 20.0
READ_ATTEMPTS = 2


def _runs(indices: Sequence[int], most: int) -> list[list[int]]:
    """Sorted ``indices`` cut into runs of consecutive ones, at most ``most`` long."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][-1] == i - 1 and len(runs[-1]) < most:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


@dataclass(frozen=True)
class Holding:
    """A verified shard, as the store holding it lists it."""

    node: str  # the node whose store holds it
    addr: str  # that store's shard service
    segment: str
    origin: str  # the node whose rank wrote it
    rank: int  # the rank that wrote it (of ``world_size`` ranks)
    step: int
    epoch: str
    world_size: int
    data_len: int
    chunk_size: int


@dataclass(frozen=True)
class Candidate:
    """A step held in full across the live stores: every old rank's shard, somewhere."""

    step: int
    epoch: str
    world_size: int
    holders: dict[int, tuple[Holding, ...]]  # old rank -> who holds its shard

    @property
    def key(self) -> tuple[int, str, int]:
        return self.step, self.epoch, self.world_size


def _client(addr: str, secret: bytes, run_id: str, sender: str) -> Client:
    return Client(addr, secret, run_id, sender, peer="snapshot store",
                  hint="is that node still up? (its shards are read from another copy)",
                  max_frame_bytes=protocol.MAX_FRAME_BYTES)


def holding(r: dict[str, Any]) -> Holding:
    """A holding from a survey's record (ftrun.store.survey: the store's listing, with the
    ``node`` and ``addr`` that hold it)."""
    return Holding(str(r["node"]), str(r["addr"]), r["segment"], r["origin"], int(r["rank"]),
                   int(r["step"]), r["epoch"], int(r["world_size"]), int(r["data_len"]),
                   int(r["chunk_size"]))


def complete(holdings: Iterable[Holding]) -> list[Candidate]:
    """The steps whose every old rank's shard is held somewhere, newest first."""
    sets: dict[tuple[int, str, int], dict[int, list[Holding]]] = {}
    for h in holdings:
        if 0 <= h.rank < h.world_size:
            sets.setdefault((h.step, h.epoch, h.world_size), {}).setdefault(h.rank, []).append(h)
    out = [Candidate(step, epoch, world, {r: tuple(hs) for r, hs in sorted(by_rank.items())})
           for (step, epoch, world), by_rank in sets.items() if len(by_rank) == world]
    return sorted(out, key=lambda c: (-c.step, c.epoch, c.world_size))


def describe_gaps(holdings: Iterable[Holding], most: int = 3) -> str:
    """What the newest steps held lack: the old ranks whose shard no live store holds."""
    sets: dict[tuple[int, str, int], set[int]] = {}
    for h in holdings:
        sets.setdefault((h.step, h.epoch, h.world_size), set()).add(h.rank)
    out = []
    gaps = [(key, sorted(set(range(key[2])) - ranks)) for key, ranks in sets.items()]
    for (step, _epoch, world), gone in sorted((g for g in gaps if g[1]),
                                              key=lambda g: -g[0][0])[:most]:
        out.append(f"step {step} of {world} ranks lacks rank(s) "
                   f"{', '.join(map(str, gone[:8]))}{' ...' if len(gone) > 8 else ''}")
    return "; ".join(out) or "nothing held"


class ShardReader:
    """One old rank's shard of one step, read chunk by chunk from whoever holds it.

    Holders on ``node`` (this rank's own) are read straight from shared memory, the others
    over the wire; each chunk is checked against the holder's hash table and taken from the
    next holder when it does not match or the holder fails. Verified chunks are cached.
    """

    def __init__(self, holders: Sequence[Holding], node: str, secret: bytes, run_id: str,
                 sender: str) -> None:
        if not holders:
            raise FtrunError("a shard with no holder")
        self.holders = sorted(holders, key=lambda h: (h.node != node, h.node))
        self.node = node
        self.rank = holders[0].rank
        self.step = holders[0].step
        self._secret, self._run_id, self._sender = secret, run_id, sender
        self._clients: dict[str, Client] = {}
        self._meta: dict[str, tuple[dict[str, Any], list[int], int, int]] = {}
        self._failed: set[str] = set()  # holders that failed: tried last
        self._chunks: dict[int, bytes | memoryview] = {}
        self.sources: dict[str, int] = {}  # node -> chunks taken from it
        self.refused: list[str] = []  # why chunks were not taken from a holder

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def __str__(self) -> str:
        return f"rank {self.rank}'s shard of step {self.step}"

    def _order(self) -> list[Holding]:
        return sorted(self.holders, key=lambda h: (h.segment + h.node) in self._failed)

    def _open_local(self, h: Holding) -> tuple[shm.Segment, shm.Header]:
        seg = shm.Segment.open(h.segment)
        try:
            hd = seg.header()
            if (hd.state, hd.step, hd.epoch) != (shm.VERIFIED, h.step, h.epoch):
                raise FtrunError(f"{h.segment} now holds step {hd.step} ({hd.state_name})")
        except Exception:
            seg.close()
            raise
        return seg, hd

    def _fetch_meta(self, h: Holding) -> tuple[dict[str, Any], list[int], int, int]:
        key = h.segment + h.node
        if key not in self._meta:
            if h.node == self.node:
                seg, hd = self._open_local(h)
                try:
                    blob, hashes = seg.manifest_bytes(hd), seg.hashes(hd)
                finally:
                    seg.close()
                data_len, chunk_size = hd.data_len, hd.chunk_size
            else:
                reply = self._client(h).request(
                    "shard_meta_request", {"segment": h.segment, "step": h.step,
                                           "epoch": h.epoch}, "shard_meta", READ_TIMEOUT_S,
                    attempts=READ_ATTEMPTS)
                if len(reply.frames) != 2:
                    raise IntegrityError(f"shard_meta with {len(reply.frames)} frames")
                blob, hashes = bytes(reply.frames[0]), verify.unpack_hashes(reply.frames[1])
                data_len, chunk_size = int(reply.body["data_len"]), int(reply.body["chunk_size"])
            doc = parse_manifest(blob)
            if (doc["step"], doc["rank"], doc["world_size"]) != (h.step, h.rank, h.world_size) \
                    or len(hashes) != shm.chunk_count(data_len, chunk_size):
                raise IntegrityError(f"{h.segment} on node {h.node}: its manifest or hash table "
                                     "does not describe the shard listed")
            self._meta[key] = (doc, hashes, data_len, chunk_size)
        return self._meta[key]

    def _client(self, h: Holding) -> Client:
        if h.addr not in self._clients:
            self._clients[h.addr] = _client(h.addr, self._secret, self._run_id, self._sender)
        return self._clients[h.addr]

    def meta(self) -> tuple[dict[str, Any], int, int]:
        """(manifest, data length, chunk size), from the first holder that gives them."""
        problems = []
        for h in self._order():
            try:
                doc, _, data_len, chunk_size = self._fetch_meta(h)
                return doc, data_len, chunk_size
            except (FtrunError, OSError, ValueError, KeyError) as e:
                self._failed.add(h.segment + h.node)
                problems.append(f"node {h.node}: {e}")
        raise IntegrityError(f"{self}: no holder gave its manifest ({'; '.join(problems)})")

    def _read_from(self, h: Holding, want: list[int]) -> dict[int, bytes | memoryview]:
        """Chunks ``want`` from holder ``h``, each verified; those that fail are left out."""
        doc, hashes, data_len, chunk_size = self._fetch_meta(h)
        ranges = verify.chunk_ranges(data_len, chunk_size)
        got: dict[int, bytes | memoryview] = {}
        if h.node == self.node:
            seg, hd = self._open_local(h)
            try:
                data = seg.data(hd)
                for i in want:
                    lo, hi = ranges[i]
                    got[i] = bytes(data[lo:hi])
                if seg.header() != hd:
                    raise FtrunError(f"{h.segment} changed while it was read")
            finally:
                seg.close()
        else:
            client = self._client(h)
            for run in _runs(want, verify.READ_CHUNKS_MAX):
                got.update(self._read_run(client, h, run[0], len(run)))
        out: dict[int, bytes | memoryview] = {}
        for i, blob in got.items():
            if xxhash.xxh3_64_intdigest(blob) == hashes[i] and len(blob) == ranges[i][1] - ranges[i][0]:
                out[i] = blob
                continue
            why = (f"{self} on node {h.node}: chunk {i} does not match its hash: "
                   f"{verify.describe(doc, chunk_size, [i], data_len)}")
            log.error("%s; reading it from another copy", why)
            self.refused.append(why)
        return out

    def _read_run(self, client: Client, h: Holding, first: int, count: int) -> dict[int, Any]:
        reply = client.request("shard_read_request", {
            "segment": h.segment, "step": h.step, "epoch": h.epoch, "first": first,
            "count": count}, "shard_data", READ_TIMEOUT_S, attempts=READ_ATTEMPTS)
        if len(reply.frames) != count:
            raise IntegrityError(f"shard_data with {len(reply.frames)} frames for {count} chunks")
        return {first + k: memoryview(f) for k, f in enumerate(reply.frames)}

    def chunks(self, want: Iterable[int]) -> dict[int, bytes | memoryview]:
        """The verified chunks ``want`` (IntegrityError when some holder has none of them)."""
        missing = sorted(set(want) - set(self._chunks))
        problems = []
        for h in self._order():
            if not missing:
                break
            try:
                got = self._read_from(h, missing)
            except (FtrunError, OSError, ValueError, KeyError) as e:
                self._failed.add(h.segment + h.node)
                problems.append(f"node {h.node}: {e}")
                log.warning("%s: node %s failed (%s); trying another copy", self, h.node, e)
                continue
            if len(got) < len(missing):
                self._failed.add(h.segment + h.node)
            self._chunks.update(got)
            self.sources[h.node] = self.sources.get(h.node, 0) + len(got)
            missing = [i for i in missing if i not in got]
        if missing:
            raise IntegrityError(
                f"{self}: chunk(s) {', '.join(map(str, missing[:8]))} verified on no holder "
                f"({'; '.join(problems + self.refused) or 'every copy failed'})")
        return {i: self._chunks[i] for i in want}

    def read(self, offset: int, nbytes: int) -> bytes:
        """Bytes ``offset .. offset + nbytes`` of the data region, from verified chunks."""
        _, data_len, chunk_size = self.meta()
        if nbytes == 0:
            return b""
        if offset < 0 or offset + nbytes > data_len:
            raise IntegrityError(f"{self}: bytes {offset}+{nbytes} outside its {data_len}")
        first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
        parts = self.chunks(range(first, last + 1))
        blob = b"".join(bytes(parts[i]) for i in range(first, last + 1))
        start = offset - first * chunk_size
        return blob[start:start + nbytes]

    def whole(self) -> bytearray:
        """The whole data region, every chunk verified."""
        _, data_len, chunk_size = self.meta()
        n = shm.chunk_count(data_len, chunk_size)
        out = bytearray(data_len)
        for at in range(0, n, 64):
            for i, blob in self.chunks(range(at, min(n, at + 64))).items():
                out[i * chunk_size:i * chunk_size + len(blob)] = blob
            for i in range(at, min(n, at + 64)):
                self._chunks.pop(i, None)  # copied out: no second copy kept
        return out
