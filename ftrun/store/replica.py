"""Replicas of committed snapshot shards in peer nodes' stores.

Each node's store sends the shards of its newest committed step to the ``m - 1`` peers that
the coordinator's placement names (:mod:`ftrun.coordinator.placement`), and keeps the replicas
its peers send it. Everything here runs on threads of the store process, never in a training
process and never on the store's message loop:

- :class:`ReplicaSender` (one thread) follows the newest committed step. It streams each local
  shard of it straight from the rank's shared-memory segment to each peer: a ``replica_begin``
  with the manifest and the chunk hash table as binary frames, then one ``replica_chunk`` per
  chunk (4 MiB: the unit the rank hashed), several in flight, then ``replica_end``. It reads
  the segment header before and after copying each chunk: if the rank has begun rewriting
  the buffer (it never asks the sender), the transfer of that step is abandoned; a rank never
  waits for replication. A step in flight is finished even when newer steps commit
  meanwhile (else nothing would become durable while a transfer takes longer than the
  snapshot interval); the next round takes the newest committed step, skipping those
  between. Only a new epoch (the workers restarted) drops the step in flight (superseded).
  An optional rate cap paces the chunks.
- :class:`ReplicaReceiver` (one thread, its own TCP socket) checks every chunk's xxh3 against
  the hash table it was sent (:mod:`ftrun.snapshot.verify`), writes it into a replica segment
  it owns, and marks the replica verified only once every chunk has been checked. A chunk
  that does not match is refused (its ack names it and the tensors in it); ``replica_end``
  then answers with an error naming the chunks, and the replica stays unverified. It keeps
  two steps per (origin node, rank): the newest durable one (as its store knows it) and the
  newest after it, and tells the coordinator of each verified replica, which counts a step
  *durable* once every rank's shard has ``m - 1`` verified replicas
  (ftrun.coordinator.commits), and of each verified replica it overwrites, which no longer
  counts.

Replica segments are named ``<job prefix minus its dash>.rep-<holder>-<origin>-r<rank>-s<slot>``
(holder and origin as short hashes of their node ids): nothing that lists a node's own rank
segments (the job prefix ends in ``-``) ever sees them, and two stores of one job on a host
never share one. The origin's full node id is written at the end of the segment's manifest
slot (past the manifest, outside its hash). A store's replicas are removed when it stops (the
job's end), and by the usual leftover cleaning once its launcher is gone.

**Capacity.** A replica segment takes room in the same tmpfs as the node's own rank buffers.
Before creating one the receiver checks the free space (``statvfs``), keeping back room for
the second buffer of every local rank that has only one so far and a sixteenth of the tmpfs
for everything else that uses it; a replica that does not fit is refused at
``replica_begin`` with the reason in the reply (``refused``). The sender gives that step up
for that peer (its failure log is rate-limited), the store reports the reason
(``replica_refused``, shown in ``ftrun status``), and nothing on the training path notices.

**Restarted store.** A store that crashed and was restarted by its launcher adopts the replica
segments its predecessor held: each verified one is checked again (its manifest and hash
table against their own hashes, every chunk against the table), registered in the catalog,
and reported to the coordinator again; torn or damaged ones are removed (peers send again).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrun import protocol
from ftrun.errors import ConfigError, FtrunError, IntegrityError, ProtocolError, UnreachableError
from ftrun.protocol import messages as m
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Client, RateLimiter, Server
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import parse_manifest
from ftrun.store.catalog import (  # replica naming lives with the catalog
    Record,
    holder_prefix,
    replica_name,
)

log = logging.getLogger("ftrun.store.replica")

KEEP_STEPS = 2  # replicas kept per (origin, rank): the newest two steps
WINDOW = 8  # chunks in flight per transfer (measured: 4 reaches half the rate of 8)
ACK_TIMEOUT_S = 10.0  # no ack for this long: the peer is gone or stuck, give the step up
REQUEST_TIMEOUT_S = 5.0  # replica_begin / replica_end
# replica_begin may create the replica segment, and pre-fault it at first-touch speed
# (~2 GB/s measured on an idle host; a 512 MiB one took over 6 s on 2 cores at load 7): the
# wait for its answer grows with the shard.
CREATE_BYTES_PER_S = 100e6
POLL_S = 0.1
SERVE_POLL_S = 0.1
REPORT_TIMEOUT_S = 2.0
BEHIND_WARN_EVERY_S = 60.0
RETRY_S = 1.0  # a step whose transfer to a peer failed is sent again after this
# The origin's node id, at the end of a replica's manifest slot: magic, length, utf-8 id.
ORIGIN_MAGIC = b"FTRUNOR1"
ORIGIN_SLOT = 1024  # bytes kept at the end of the manifest slot for it
SHM_SPARE_FRACTION = 16  # 1/16 of the tmpfs stays free for other users of it
_REPLICA_RE = re.compile(r"-r(\d+)-s(\d+)$")  # rank and slot at a replica name's end


def write_origin(seg: shm.Segment, origin: str) -> None:
    """Record ``origin`` at the end of the manifest slot of ``seg``."""
    blob = origin.encode()
    if len(blob) > ORIGIN_SLOT - len(ORIGIN_MAGIC) - 2:
        raise ProtocolError(f"node id {origin[:80]!r}... is {len(blob)} bytes; at most "
                            f"{ORIGIN_SLOT - len(ORIGIN_MAGIC) - 2} fit")
    h = seg.header()
    end = shm.HEADER_SIZE + h.manifest_cap
    seg.mm[end - ORIGIN_SLOT:end] = (blob + struct.pack("<H", len(blob)) + ORIGIN_MAGIC).rjust(
        ORIGIN_SLOT, b"\0")


def read_origin(seg: shm.Segment) -> str | None:
    """The origin recorded by :func:`write_origin`, or None."""
    h = seg.header()
    end = shm.HEADER_SIZE + h.manifest_cap
    if h.manifest_cap < ORIGIN_SLOT + h.manifest_len:
        return None
    tail = bytes(seg.mm[end - ORIGIN_SLOT:end])
    if tail[-len(ORIGIN_MAGIC):] != ORIGIN_MAGIC:
        return None
    (n,) = struct.unpack("<H", tail[-len(ORIGIN_MAGIC) - 2:-len(ORIGIN_MAGIC)])
    if n > ORIGIN_SLOT - len(ORIGIN_MAGIC) - 2:
        return None
    try:
        return tail[-len(ORIGIN_MAGIC) - 2 - n:-len(ORIGIN_MAGIC) - 2].decode()
    except UnicodeDecodeError:
        return None


# -- receiving ----------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One replica segment and the transfer filling it."""

    name: str
    seg: shm.Segment
    origin: str
    rank: int
    number: int  # the slot in the segment's name (s<number>)
    step: int = -1
    epoch: str = ""
    verified: bool = False
    doc: dict[str, Any] = field(default_factory=dict)
    hashes: list[int] = field(default_factory=list)
    good: set[int] = field(default_factory=set)  # chunks checked and written
    bad: dict[int, str] = field(default_factory=dict)  # chunk -> why it was refused
    done_at: float = 0.0


class ReplicaReceiver:
    """Takes replicas from peers' senders on a TCP socket of its own (one thread).

    ``report(origin, epoch, rank, step)`` is called, on this thread, for every replica that
    became verified (the store tells the coordinator), and for every one adopted from a
    previous store of this node. ``refused`` is why the last replica was refused for want of
    room (None once one fits again).
    """

    def __init__(self, run_id: str, node_id: str, owner_pid: int, secret: bytes,
                 report: Callable[[str, str, int, int], None] | None = None,
                 durable: Callable[[], tuple[str, int]] | None = None,
                 dropped: Callable[[str, str, int, int], None] | None = None) -> None:
        self.run_id = run_id
        self.node_id = node_id
        self.owner_pid = owner_pid
        self._secret = secret
        self._report = report
        # (epoch, newest durable step) as this node's store knows it: that step's replica is
        # kept; ``dropped(origin, epoch, rank, step)``: a verified replica was overwritten.
        self._durable = durable
        self._dropped = dropped
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], list[_Slot]] = {}
        self._service = Service(Server("replica receiver", secret, run_id, {
            "replica_begin": self._on_begin,
            "replica_chunk": self._on_chunk,
            "replica_end": self._on_end,
        }, sender=f"replicas:{node_id}", max_frame_bytes=protocol.MAX_FRAME_BYTES, typed=True),
            poll_s=SERVE_POLL_S, max_messages=64, setup=self._adopt_and_report,
            thread_name="ftrun-replica-recv")
        self.address = ""
        self.refused: str | None = None
        self._refusals = RateLimiter(BEHIND_WARN_EVERY_S)
        self.adopted = threading.Event()  # set once the previous store's replicas are taken

    def start(self, host: str) -> str:
        """Bind ``host`` on a port the OS picks, serve on a thread; returns ``host:port``.

        The thread first adopts the replicas a previous store of this node left (re-hashing
        them takes time; peers' requests queue on the socket meanwhile)."""
        self.address = self._service.bind_tcp(host)
        self._service.start()
        log.info("taking replicas on %s", self.address)
        return self.address

    def _adopt_and_report(self) -> None:
        """The serving thread's first work: adopt, and report what was adopted."""
        try:
            adopted = self.adopt()
        except Exception:  # noqa: BLE001 - without them, peers send again
            log.exception("adopting the replicas of a previous store failed; peers send again")
            adopted = []
        finally:
            self.adopted.set()
        for s in adopted:
            if self._report is not None and not self._service.stopping:
                self._report(s.origin, s.epoch, s.rank, s.step)

    def stop(self, unlink: bool, timeout_s: float = 5.0) -> None:
        self._service.stop(timeout_s)
        with self._lock:
            slots = [s for ss in self._slots.values() for s in ss]
            self._slots.clear()
        for slot in slots:
            if unlink:
                slot.seg.unlink()
            else:
                slot.seg.close()

    # -- adopting a previous store's replicas --------------------------------------------------
    def adopt(self) -> list[_Slot]:
        """Take over the replica segments of this node left by a previous store (it crashed
        and was restarted): the verified ones whose data still matches their hash table are
        kept, everything else is removed. Returns the slots adopted."""
        adopted: list[_Slot] = []
        dropped: list[str] = []
        for path in shm.list_segments(holder_prefix(self.run_id, self.node_id)):
            try:
                seg = shm.Segment.open(path)
            except (OSError, IntegrityError, ValueError) as e:
                dropped.append(f"{path.name} ({e})")
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                continue
            try:
                slot = self._adopt_one(seg)
            except (IntegrityError, ProtocolError, ValueError, KeyError) as e:
                dropped.append(f"{seg.name} ({e})")
                seg.unlink()
                continue
            with self._lock:
                slots = self._slots.setdefault((slot.origin, slot.rank), [])
                if len(slots) >= KEEP_STEPS or any(s.number == slot.number for s in slots):
                    dropped.append(f"{seg.name} (a slot too many)")
                    seg.unlink()
                    continue
                slots.append(slot)
            adopted.append(slot)
        if adopted or dropped:
            log.info("adopted %d replica(s) a previous store of this node held%s%s",
                     len(adopted), "; removed " if dropped else "", "; ".join(dropped[:4]))
        return adopted

    def _adopt_one(self, seg: shm.Segment) -> _Slot:
        found = _REPLICA_RE.search(seg.name)
        if found is None:
            raise ValueError("not named like a replica segment")
        rank, number = int(found.group(1)), int(found.group(2))
        h = seg.header()
        if h.state != shm.VERIFIED:
            raise IntegrityError(f"{h.state_name}, not verified (a transfer was cut)")
        origin = read_origin(seg)
        if origin is None:
            raise IntegrityError("no origin node recorded")
        if replica_name(self.run_id, self.node_id, origin, rank, number) != seg.name:
            raise IntegrityError(f"its recorded origin {origin!r} does not match its name")
        if number >= KEEP_STEPS:
            raise ValueError(f"slot {number} beyond the {KEEP_STEPS} kept")
        doc = parse_manifest(seg.manifest_bytes(h))
        hashes = seg.hashes(h)
        bad = verify.bad_chunks(seg.data(h), h.chunk_size, hashes)
        if bad:
            raise IntegrityError(verify.describe(doc, h.chunk_size, bad, h.data_len))
        n = len(hashes)
        return _Slot(seg.name, seg, origin, rank, number, h.step, h.epoch, True, doc, hashes,
                     set(range(n)), {}, time.monotonic())

    # -- room ----------------------------------------------------------------------------------
    def _room_for(self, nbytes: int) -> str | None:
        """Why a new replica segment of ``nbytes`` does not fit in the tmpfs (None: it does).
        Kept back: the second buffer of every local rank that has one so far (it creates the
        other at its next snapshot), and 1/SHM_SPARE_FRACTION of the tmpfs."""
        free = shm.shm_free_bytes()
        total = os.statvfs(shm.SHM_DIR)
        size = total.f_blocks * total.f_frsize
        own: dict[int, list[int]] = {}
        for path in shm.list_segments(shm.job_prefix(self.run_id)):
            found = re.search(r"-r(\d+)-b(\d+)$", path.name)
            if found is None:
                continue
            try:
                own.setdefault(int(found.group(1)), []).append(path.stat().st_size)
            except OSError:
                continue
        ranks_reserve = sum(max(sizes) for sizes in own.values() if len(sizes) < 2)
        keep = ranks_reserve + size // SHM_SPARE_FRACTION
        if nbytes + keep <= free:
            return None
        mib = 2**20
        return (f"{shm.SHM_DIR} on {self.node_id} has {free / mib:.0f} MiB free of "
                f"{size / mib:.0f} MiB; a replica of {nbytes / mib:.0f} MiB would leave less "
                f"than the {keep / mib:.0f} MiB kept for this node's own rank buffers "
                f"({ranks_reserve / mib:.0f} MiB) and other users (1/{SHM_SPARE_FRACTION}). "
                "Enlarge /dev/shm (Docker --shm-size), or lower --replicas")

    # -- what is held ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Shared memory the replica segments take."""
        with self._lock:
            return sum(len(s.seg.mm) for ss in self._slots.values() for s in ss)

    def verified(self) -> list[tuple[str, str, int, int]]:
        """(origin, epoch, rank, step) of every verified replica held here, oldest first."""
        with self._lock:
            slots = sorted((s for ss in self._slots.values() for s in ss if s.verified),
                           key=lambda s: s.done_at)
            return [(s.origin, s.epoch, s.rank, s.step) for s in slots]

    def records(self) -> list[Record]:
        """Catalog records of the replicas held here (origin: the node that sent them)."""
        out = []
        with self._lock:
            slots = [s for ss in self._slots.values() for s in ss]
        for s in slots:
            try:
                h = s.seg.header()
            except IntegrityError:
                continue
            out.append(Record(s.name, s.rank, s.number, s.origin,
                              h.step, h.epoch, h.state_name, h.data_len, h.chunk_size,
                              list(s.hashes) if s.verified else None))
        return sorted(out, key=lambda r: (r.origin, r.rank, r.buffer))

    # -- handlers (the receiver thread) -------------------------------------------------------
    def _slot_for(self, origin: str, rank: int, step: int, epoch: str) -> tuple[_Slot | None, int]:
        """(a slot already holding this step verified, or None; the slot index to fill: the
        list's length for a new one).

        Overwritten first: a slot not holding a verified replica, then one of another epoch,
        then the older step, but never the replica of the newest durable step (as this store
        knows it) while the other slot's step is not durable: a step is durable because its
        replicas exist, and the steps after it need not become durable (replication behind, a
        replica refused), so dropping it for a newer one could leave no step complete when the
        origin's host is lost."""
        slots = self._slots.get((origin, rank), [])
        for s in slots:
            if s.verified and s.step == step and s.epoch == epoch:
                return s, -1
        if len(slots) < KEEP_STEPS:
            return None, len(slots)
        d_epoch, d_step = self._durable() if self._durable is not None else ("", -1)

        def worth(i: int) -> tuple[bool, bool, bool, int]:
            s = slots[i]
            return (s.verified, s.epoch == epoch,
                    s.epoch == d_epoch and s.step == d_step, s.step)

        return None, min(range(len(slots)), key=worth)

    def _on_begin(self, msg: protocol.Message) -> m.ReplicaReady:
        b: m.ReplicaBegin = msg.body
        if len(msg.frames) != 2:
            raise ProtocolError("replica_begin carries the manifest and the chunk hash table "
                                f"as two frames, got {len(msg.frames)}")
        manifest, table = bytes(msg.frames[0]), msg.frames[1]
        hashes = verify.unpack_hashes(table)
        data_len, chunk_size = b.data_len, b.chunk_size
        if chunk_size <= 0 or chunk_size > protocol.MAX_FRAME_BYTES:
            raise ProtocolError(f"chunk size {chunk_size} is outside 1..{protocol.MAX_FRAME_BYTES}")
        if len(hashes) != shm.chunk_count(data_len, chunk_size):
            raise IntegrityError(f"{len(hashes)} chunk hashes for {data_len} bytes in chunks of "
                                 f"{chunk_size}")
        doc = parse_manifest(manifest)
        with self._lock:
            reply, dropped = self._begin_locked(b, manifest, hashes, doc)
        if dropped is not None and self._dropped is not None:
            self._dropped(*dropped)  # after the lock: it asks the coordinator
        return reply

    def _begin_locked(self, b: m.ReplicaBegin, manifest: bytes, hashes: list[int],
                      doc: dict[str, Any]) -> tuple[m.ReplicaReady,
                                                     tuple[str, str, int, int] | None]:
        """replica_begin under the lock: (the reply, the verified replica its slot held, as
        (origin, epoch, rank, step), when one was overwritten)."""
        origin, rank, step, epoch = b.origin, b.rank, b.step, b.epoch
        data_len, chunk_size = b.data_len, b.chunk_size
        dropped: tuple[str, str, int, int] | None = None
        have, index = self._slot_for(origin, rank, step, epoch)
        if have is not None:
            return m.ReplicaReady(have=True), None
        slots = self._slots.setdefault((origin, rank), [])
        old = slots[index] if index < len(slots) else None
        if old is not None and old.verified:
            # The coordinator counted it towards a durable step: no longer held here.
            dropped = (old.origin, old.epoch, old.rank, old.step)
        number = old.number if old is not None else min(
            set(range(KEEP_STEPS)) - {s.number for s in slots})
        seg = self._segment(old, origin, rank, number, manifest, b.n_tensors, data_len,
                            chunk_size)
        if seg is None:
            assert self.refused is not None
            allowed, suppressed = self._refusals.allow("room")
            if allowed:
                log.warning("replica of rank %d step %d from %s refused: %s%s", rank, step,
                            origin, self.refused,
                            f" ({suppressed} more refused)" if suppressed else "")
            return m.ReplicaReady(have=False, refused=self.refused), None
        if old is not None and seg is not old.seg:
            old.seg.close()
        write_origin(seg, origin)
        # Torn until every chunk is in and checked.
        seg.set_state(shm.WRITING, step=step, epoch=epoch, data_len=data_len,
                      n_tensors=b.n_tensors, manifest_len=0, manifest_xxh3=0,
                      hashes_xxh3=0, staged_at=0.0)
        xm = seg.write_manifest(manifest)
        seg.set_state(shm.WRITING, manifest_len=len(manifest), manifest_xxh3=xm)
        xh = seg.write_hashes(hashes)
        slot = _Slot(seg.name, seg, origin, rank, number, step, epoch, False, doc, hashes)
        slot.seg.set_state(shm.WRITING, hashes_xxh3=xh)
        if index < len(slots):
            slots[index] = slot
        else:
            slots.append(slot)
        return m.ReplicaReady(have=False), dropped

    def _segment(self, old: _Slot | None, origin: str, rank: int, number: int, manifest: bytes,
                 n_tensors: int, data_len: int, chunk_size: int) -> shm.Segment | None:
        """The slot's segment, re-created when this shard does not fit its layout; None (and
        ``refused`` says why) when a new one does not fit in the tmpfs."""
        if old is not None:
            h = old.seg.header()
            n = shm.chunk_count(data_len, chunk_size)
            if (h.chunk_size == chunk_size and h.manifest_cap >= len(manifest) + ORIGIN_SLOT
                    and h.hash_slots >= max(1, n) and h.data_off + data_len <= h.capacity):
                return old.seg
        manifest_cap = 2 * len(manifest) + 4096
        capacity = shm.layout_for(manifest_cap, data_len, chunk_size)[2]
        self.refused = self._room_for(capacity)
        if self.refused is not None:
            return None
        name = replica_name(self.run_id, self.node_id, origin, rank, number)
        try:
            return shm.Segment.create(name, manifest_cap=manifest_cap, n_tensors=n_tensors,
                                      data_len=data_len, owner_pid=self.owner_pid,
                                      chunk_size=chunk_size)
        except ConfigError as e:  # posix_fallocate found less room than statvfs said
            self.refused = str(e)
            return None

    def _find(self, origin: str, rank: int, step: int) -> _Slot | None:
        for s in self._slots.get((origin, rank), []):
            if s.step == step and not s.verified:
                return s
        return None

    def _on_chunk(self, msg: protocol.Message) -> m.ReplicaAck:
        b: m.ReplicaChunk = msg.body
        origin, rank, step, i = b.origin, b.rank, b.step, b.chunk

        def refuse(reason: str) -> m.ReplicaAck:
            return m.ReplicaAck(rank=rank, step=step, chunk=i, ok=False, reason=reason)

        with self._lock:
            slot = self._find(origin, rank, step)
            if slot is None:
                return refuse(f"no transfer of rank {rank} step {step} from {origin} in "
                              "progress here (superseded, or never begun)")
            h = slot.seg.header()
            ranges = verify.chunk_ranges(h.data_len, h.chunk_size)
            if len(msg.frames) != 1 or not 0 <= i < len(ranges):
                return refuse(f"chunk {i} of {len(ranges)}, with {len(msg.frames)} frame(s)")
            lo, hi = ranges[i]
            data = memoryview(msg.frames[0])
            if len(data) != hi - lo or verify.bad_chunks(data, h.chunk_size, [slot.hashes[i]]):
                what = (f"{len(data)} bytes instead of {hi - lo}" if len(data) != hi - lo else
                        verify.describe(slot.doc, h.chunk_size, [i], h.data_len))
                reason = (f"replica of rank {rank} step {step} from {origin}: chunk {i} "
                          f"refused: {what}")
                slot.bad[i] = reason
                slot.good.discard(i)
                log.error("%s", reason)
                return refuse(reason)
            slot.seg.mm[h.data_off + lo:h.data_off + hi] = data
            slot.good.add(i)
            slot.bad.pop(i, None)
        return m.ReplicaAck(rank=rank, step=step, chunk=i, ok=True)

    def _on_end(self, msg: protocol.Message) -> m.ReplicaDone:
        b: m.ReplicaEnd = msg.body
        origin, rank, step = b.origin, b.rank, b.step
        with self._lock:
            slot = self._find(origin, rank, step)
            if slot is None:
                raise FtrunError(f"no transfer of rank {rank} step {step} from {origin} in "
                                 "progress here; send it again from replica_begin")
            n = len(slot.hashes)
            missing = [i for i in range(n) if i not in slot.good]
            if missing:
                bad = sorted(slot.bad)
                raise IntegrityError(
                    f"replica of rank {rank} step {step} from {origin} not verified: "
                    + (f"chunk(s) {', '.join(map(str, bad))} refused ({slot.bad[bad[0]]})"
                       if bad else f"chunk(s) {', '.join(map(str, missing[:8]))} missing"))
            slot.seg.set_state(shm.VERIFIED, staged_at=time.time())
            slot.verified, slot.done_at = True, time.monotonic()
            epoch = slot.epoch
        log.debug("replica of rank %d step %d from %s verified (%d chunks)", rank, step,
                  origin, n)
        if self._report is not None:
            self._report(origin, epoch, rank, step)
        return m.ReplicaDone(rank=rank, step=step, verified=True)


# -- sending ------------------------------------------------------------------------------------


class Abandoned(Exception):
    """The transfer of a step stops: why is the message."""


class Refused(FtrunError):
    """The peer has no room for the replica (its reason is the message)."""


class _Pacer:
    """Keeps the bytes sent at or below ``rate`` bytes/s (0: no cap), with one chunk of burst."""

    def __init__(self, rate_bytes_s: float, stop: threading.Event) -> None:
        self.rate = rate_bytes_s
        self._stop = stop
        self._t0 = time.monotonic()
        self._sent = 0

    def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        due = self._t0 + self._sent / self.rate
        delay = due - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)
        elif delay < -1.0:  # idle for a while: no credit saved up beyond a second
            self._t0, self._sent = time.monotonic(), 0
        self._sent += nbytes


@dataclass(frozen=True)
class Peer:
    node_id: str
    address: str  # host:port of its ReplicaReceiver


class ReplicaSender:
    """Sends this node's shards of the newest committed step to its peers (one thread).

    ``committed()`` gives (epoch, step) as the store knows it; :meth:`set_peers` takes the
    placement's peers for this node. ``stats`` counts steps sent, superseded and abandoned.
    """

    def __init__(self, run_id: str, node_id: str, owner_pid: int, secret: bytes,
                 committed: Callable[[], tuple[str, int]], *, rate_bytes_s: float = 0.0,
                 window: int = WINDOW, ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        self.run_id = run_id
        self.node_id = node_id
        self.owner_pid = owner_pid
        self._secret = secret
        self._committed = committed
        self.rate_bytes_s = rate_bytes_s
        self.window = max(1, window)
        self.ack_timeout_s = ack_timeout_s
        self._peers: tuple[Peer, ...] = ()
        self._clients: dict[str, Client] = {}
        self._acks: dict[tuple[int, int, int], tuple[bool, str]] = {}
        self._pool: list[bytearray] = []  # chunk buffers (see _stream)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done: dict[str, tuple[str, int]] = {}  # peer -> (epoch, step) last handled
        self._retry_at: dict[str, float] = {}  # peer -> when to try a failed step again
        self.stats = {"sent": 0, "superseded": 0, "abandoned": 0, "bytes": 0}
        self._behind = RateLimiter(BEHIND_WARN_EVERY_S)
        self._failed = RateLimiter(BEHIND_WARN_EVERY_S)
        self.last_outcome = ""

    # -- control ------------------------------------------------------------------------------
    @property
    def peers(self) -> tuple[Peer, ...]:
        """The nodes this store sends replicas to (empty: replication is off here)."""
        return self._peers

    def set_peers(self, peers: Sequence[Peer]) -> None:
        new = tuple(peers)
        if new != self._peers:
            log.info("replica peers: %s", ", ".join(f"{p.node_id} at {p.address}" for p in new)
                     or "none")
            self._peers = new
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ftrun-replica-send", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                self.send_pending()
            except Exception:  # noqa: BLE001 - the sender must survive anything
                log.exception("replica sender error; continuing")
                self._stop.wait(1.0)

    # -- one round ----------------------------------------------------------------------------
    def send_pending(self) -> None:
        """Send the newest committed step to every peer that does not have it yet (steps
        that committed while the previous one was in flight are skipped)."""
        epoch, step = self._committed()
        if not epoch or step <= 0:
            return
        for peer in self._peers:
            if self._stop.is_set() or self._done.get(peer.node_id) == (epoch, step) or \
                    self._retry_at.get(peer.node_id, 0.0) > time.monotonic():
                continue
            try:
                n = self.send_step(peer, epoch, step)
                self.stats["sent"] += 1
                self.last_outcome = f"step {step} to {peer.node_id}: {n} shard(s)"
                log.debug("replicated step %d to %s (%d shard(s))", step, peer.node_id, n)
            except Abandoned as e:
                key = "superseded" if "superseded" in str(e) else "abandoned"
                self.stats[key] += 1
                self.last_outcome = f"step {step} to {peer.node_id}: {e}"
                log.debug("replication of step %d to %s %s", step, peer.node_id, e)
                allowed, _ = self._behind.allow(key)
                if allowed:
                    log.warning("replication is behind the snapshots: step %d to %s %s (so far "
                                "%d step(s) sent, %d superseded, %d abandoned)", step,
                                peer.node_id, e, self.stats["sent"], self.stats["superseded"],
                                self.stats["abandoned"])
            except (FtrunError, OSError) as e:
                self.stats["abandoned"] += 1
                self.last_outcome = f"step {step} to {peer.node_id}: {e}"
                allowed, suppressed = self._failed.allow((peer.node_id, type(e)))
                if allowed:
                    more = f" ({suppressed} more failures like it)" if suppressed else ""
                    log.warning("replication of step %d to %s failed: %s%s; trying again in "
                                "%g s", step, peer.node_id, e, more, RETRY_S)
                # Not done: the step is sent again (the store keeps the newest durable step
                # in memory until a newer one has its replicas, so it is still there).
                self._retry_at[peer.node_id] = time.monotonic() + RETRY_S
                continue
            self._done[peer.node_id] = (epoch, step)

    def _local_segments(self, epoch: str, step: int) -> list[tuple[int, str]]:
        """(rank, segment name) of this node's rank buffers holding ``step`` verified."""
        out = []
        for path in shm.list_segments(shm.job_prefix(self.run_id)):
            try:
                seg = shm.Segment.open(path)
            except (OSError, IntegrityError, ValueError):
                continue
            try:
                h = seg.header()
                if (h.owner_pid == self.owner_pid and h.state == shm.VERIFIED
                        and h.step == step and h.epoch == epoch):
                    rank = int(path.name.rsplit("-", 2)[-2][1:])
                    out.append((rank, path.name))
            finally:
                seg.close()
        return sorted(out)

    def send_step(self, peer: Peer, epoch: str, step: int) -> int:
        """Send every local shard of ``step`` to ``peer``; returns how many. Raises Abandoned
        when the step is superseded or rewritten, FtrunError when the peer fails."""
        shards = self._local_segments(epoch, step)
        pacer = _Pacer(self.rate_bytes_s, self._stop)
        for rank, name in shards:
            seg = shm.Segment.open(name)
            try:
                self.send_shard(peer, seg, epoch, rank, step, pacer)
            finally:
                seg.close()
        return len(shards)

    def _client(self, peer: Peer) -> Client:
        c = self._clients.get(peer.address)
        if c is None:
            c = Client(peer.address, self._secret, self.run_id, f"replicas:{self.node_id}",
                       peer=f"replica receiver of {peer.node_id}",
                       hint="is that node's store running and its --replica-addr reachable?",
                       on_reply=self._on_reply, max_frame_bytes=protocol.MAX_FRAME_BYTES)
            self._clients[peer.address] = c
        return c

    def _on_reply(self, msg: protocol.Message) -> None:
        if msg.kind == "replica_ack":
            b = msg.body
            self._acks[(b["rank"], b["step"], b["chunk"])] = (b["ok"], b.get("reason", ""))

    def _check(self, seg: shm.Segment, epoch: str, step: int) -> shm.Header:
        h = seg.header()
        if h.state != shm.VERIFIED or h.step != step or h.epoch != epoch:
            raise Abandoned(f"abandoned: {seg.name} was rewritten (now step {h.step}, "
                            f"{h.state_name})")
        # A newer commit does not stop the step in flight: dropping it for the newest would
        # leave nothing durable whenever a transfer takes longer than the snapshot interval.
        # It ends when the rank reclaims the buffer (above: one interval after the next
        # commit at the earliest), or when the workers restart (a new epoch).
        now_epoch, now_step = self._committed()
        if now_epoch != epoch:
            raise Abandoned(f"superseded by step {now_step} of a new epoch")
        if self._stop.is_set():
            raise Abandoned("abandoned: the store is stopping")
        return h

    def send_shard(self, peer: Peer, seg: shm.Segment, epoch: str, rank: int, step: int,
                   pacer: _Pacer | None = None) -> None:
        pacer = pacer or _Pacer(self.rate_bytes_s, self._stop)
        client = self._client(peer)
        self._acks.clear()
        h = self._check(seg, epoch, step)
        manifest = seg.manifest_bytes(h)
        table = verify.pack_hashes(seg.hashes(h))
        self._check(seg, epoch, step)
        ready = client.request("replica_begin", {
            "origin": self.node_id, "epoch": epoch, "rank": rank, "step": step,
            "data_len": h.data_len, "chunk_size": h.chunk_size, "n_tensors": h.n_tensors,
        }, "replica_ready", REQUEST_TIMEOUT_S + h.data_len / CREATE_BYTES_PER_S,
            frames=[manifest, table])
        if ready.body["have"]:
            return
        if ready.body.get("refused"):
            raise Refused(f"{peer.node_id} refused the replica of rank {rank} step {step}: "
                          f"{ready.body['refused']}")
        ranges = verify.chunk_ranges(h.data_len, h.chunk_size)
        refused = self._stream(client, seg, epoch, rank, step, list(range(len(ranges))),
                               ranges, pacer)
        if refused:
            # Once more: a chunk corrupted in flight comes through now; one corrupted in
            # this node's memory is refused again, and the replica stays unverified.
            log.warning("replica of rank %d step %d: %s refused chunk(s) %s; sending them again",
                        rank, step, peer.node_id, ", ".join(map(str, refused)))
            self._stream(client, seg, epoch, rank, step, refused, ranges, pacer)
        client.request("replica_end", {"origin": self.node_id, "rank": rank, "step": step},
                       "replica_done", REQUEST_TIMEOUT_S)

    def _stream(self, client: Client, seg: shm.Segment, epoch: str, rank: int, step: int,
                chunks: list[int], ranges: list[tuple[int, int]], pacer: _Pacer) -> list[int]:
        """Send ``chunks`` pipelined (``window`` in flight); returns those refused.

        Each chunk is copied out of the rank's mapped segment before it is signed and sent
        (ZeroMQ sends it later, from its I/O thread, and the rank may begin rewriting the
        segment at any time) into one of ``window`` buffers the sender keeps, each reused once
        the chunk it held was acknowledged (a buffer still in flight when a transfer stops is
        dropped, never rewritten under ZeroMQ): fresh 4 MiB buffers for every chunk cost page
        faults and zeroing besides the copy.
        """
        pending: dict[int, bytearray] = {}  # chunk -> the buffer holding it
        refused: list[int] = []
        size = max(hi - lo for lo, hi in ranges) if ranges else 0
        free = self._buffers(min(self.window, len(chunks)), size)

        def drain(limit: int) -> None:
            """Take acks until at most ``limit`` chunks are unanswered."""
            deadline = time.monotonic() + self.ack_timeout_s
            while True:
                for i in [i for i in pending if (rank, step, i) in self._acks]:
                    ok, reason = self._acks.pop((rank, step, i))
                    free.append(pending.pop(i))
                    if not ok:
                        refused.append(i)
                        log.warning("%s", reason)
                if len(pending) <= limit:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Abandoned(f"abandoned: no ack from {client.peer} for "
                                    f"{self.ack_timeout_s:g} s")
                client.poll(left, first=True)  # back at the first ack, not at the timeout

        try:
            for i in chunks:
                lo, hi = ranges[i]
                pacer.wait(hi - lo)
                buf = free.pop()
                data = memoryview(buf)[:hi - lo]
                h = self._check(seg, epoch, step)
                with memoryview(seg.mm) as mapped:  # released at once: the segment may close
                    data[:] = mapped[h.data_off + lo:h.data_off + hi]
                self._check(seg, epoch, step)  # still the same step after the copy: not torn
                if client.send("replica_chunk", {"origin": self.node_id, "rank": rank,
                                                 "step": step, "chunk": i}, [data]) is None:
                    raise Abandoned(f"abandoned: {client.peer} does not take data")
                self.stats["bytes"] += hi - lo
                pending[i] = buf
                drain(self.window - 1)
            drain(0)
        finally:
            if pending:
                gone = {id(b) for b in pending.values()}
                self._pool = [b for b in self._pool if id(b) not in gone]
        return sorted(refused)

    def _buffers(self, n: int, size: int) -> list[bytearray]:
        """``n`` chunk buffers of ``size`` bytes, kept from one transfer to the next."""
        if any(len(b) < size for b in self._pool):
            self._pool = []
        while len(self._pool) < n:
            self._pool.append(bytearray(size))
        return list(self._pool[:n])


# -- the store's part ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaConfig:
    replicas: int  # m: copies of every shard (1: off)
    host: str  # the interface the receiver listens on
    rate_bytes_s: float = 0.0


class Replication:
    """A store's sender and receiver, started and stopped together."""

    def __init__(self, cfg: ReplicaConfig, run_id: str, node_id: str, owner_pid: int,
                 secret: bytes, committed: Callable[[], tuple[str, int]],
                 coordinator: str, term: int = 0,
                 durable: Callable[[], tuple[str, int]] | None = None) -> None:
        self.cfg = cfg
        self._coord = Client(coordinator, secret, run_id, f"replicas:{node_id}",
                             peer="coordinator", term=term)
        self.node_id = node_id
        self.receiver = ReplicaReceiver(run_id, node_id, owner_pid, secret, self._report,
                                        durable, self._report_dropped)
        self.sender = ReplicaSender(run_id, node_id, owner_pid, secret, committed,
                                    rate_bytes_s=cfg.rate_bytes_s)
        self._off: str | None = None  # why nothing is replicated now (no peer node)

    def start(self) -> str:
        address = self.receiver.start(self.cfg.host)
        self.sender.start()
        return address

    def _tell(self, kind: str, what: str, origin: str, epoch: str, rank: int,
              step: int) -> None:
        """Tell the coordinator about a replica held here (``kind``: replica_verified or
        replica_dropped); a failure is logged, never raised."""
        try:
            self._coord.request(kind, {
                "node_id": self.node_id, "origin": origin, "epoch": epoch, "rank": rank,
                "step": step}, "ack", REPORT_TIMEOUT_S)
        except (UnreachableError, FtrunError) as e:
            log.warning("coordinator: %sreplica of rank %d step %d not reported: %s", what,
                        rank, step, e)

    def _report(self, origin: str, epoch: str, rank: int, step: int) -> None:
        self._tell("replica_verified", "", origin, epoch, rank, step)

    def _report_dropped(self, origin: str, epoch: str, rank: int, step: int) -> None:
        self._tell("replica_dropped", "dropped ", origin, epoch, rank, step)

    def retarget(self, coordinator: str, term: int) -> None:
        """Report to the coordinator at ``coordinator`` (term ``term``) from now on."""
        self._coord.retarget(coordinator, term)

    def reteach(self) -> None:
        """Report every verified replica held here again (to a restarted coordinator)."""
        for origin, epoch, rank, step in self.receiver.verified():
            self._report(origin, epoch, rank, step)

    def set_plan(self, body: dict[str, Any]) -> None:
        """Take the coordinator's ``replica_plan``: this node's peers. Says once (and again
        after peers came and went) when there is no peer to replicate to."""
        peers = [Peer(p["node_id"], p["addr"]) for p in body["peers"]]
        off = body.get("off") if not peers else None
        if off != self._off:
            if off:
                log.warning("replicas are off: %s (%d live node(s) take replicas; --replicas "
                            "%d needs %d); snapshots stay on this node only", off,
                            body["members"], self.cfg.replicas, self.cfg.replicas)
            elif self._off:
                log.info("replicas are on again: %d live node(s) take replicas",
                         body["members"])
            self._off = off
        self.sender.set_peers(peers)

    def report_fields(self) -> dict[str, Any]:
        stats = self.sender.stats
        out = {"replica_addr": self.receiver.address, "replicas": self.cfg.replicas,
               "replica_sent": stats["sent"], "replica_superseded": stats["superseded"],
               "replica_abandoned": stats["abandoned"]}
        if self.receiver.refused:
            out["replica_refused"] = self.receiver.refused
        return out

    def stop(self, unlink: bool) -> None:
        self.sender.stop()
        self.receiver.stop(unlink)
        self._coord.close()
