"""The store's catalog: a record of every shard it holds.

A node's store owns the shared-memory segments of its ranks (and, later, replicas of other
nodes' shards). The catalog is the one place that finds, opens and adopts them; everyone
else asks the store (``catalog_request``) instead of opening segments by name: ``restore()``
learns where its rank's shards are, ``ftrun inspect`` what the node holds, fault injection
which byte to hit.

A record says whose shard it is (rank, origin node), of which step and epoch, in which state,
and, once staged, the hashes of its chunks. The segment header in shared memory stays the
source of truth (a rank writes it without asking); the catalog reads it on every look and
keeps the mappings open.

A process other than the store (``ftrun inspect`` when no store answers, or to read what the
stores named) uses the catalog read-only: ``Catalog.reader(run_id)`` lists the job's rank
buffers on this host without adopting any, takes one consistent look at each (``look``) and
re-hashes a segment's chunks with the format's one routine (``rehash``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftrun.errors import IntegrityError
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.api import SegmentState
from ftrun.snapshot.manifest import entries, parse_manifest

log = logging.getLogger("ftrun.store")

LOOK_ATTEMPTS = 3  # reads of a segment its rank keeps rewriting before giving up on a look
_BUFFER_RE = re.compile(r"-r(\d+)-b(\d+)$")  # a rank's buffer (a replica ends in -s<slot>)



# -- replica segments' names (the store's replica sender and receiver, and fault injection,
# name and find replicas only through these) ----------------------------------------------


def replica_prefix(run_id: str) -> str:
    """Every replica segment of the job on this host starts with this."""
    return shm.job_prefix(run_id)[:-1] + ".rep-"


def _node_tag(node_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9]", "", node_id)[-8:]
    return safe + hashlib.sha1(node_id.encode()).hexdigest()[:8]


node_tag = _node_tag  # a node id as it appears in segment names (erasure coding names them too)


def replica_name(run_id: str, holder: str, origin: str, rank: int, slot: int) -> str:
    return f"{replica_prefix(run_id)}{_node_tag(holder)}-{_node_tag(origin)}-r{rank}-s{slot}"


def holder_prefix(run_id: str, holder: str) -> str:
    return f"{replica_prefix(run_id)}{_node_tag(holder)}-"


def newest_replica(run_id: str, origin: str,
                   rank: int | None = None) -> tuple[int, shm.Segment] | None:
    """(step, opened segment) of the newest verified replica this host holds of ``origin``'s
    shards (of ``rank`` if given), or None; the caller closes the segment."""
    # Replica names: holder_prefix(holder) + origin's tag + "-r{rank}-s{slot}".
    origin_tag = replica_name(run_id, "-", origin, 0, 0)[len(holder_prefix(run_id, "-")):]
    origin_part = "-" + origin_tag.removesuffix("-r0-s0") + "-r"
    newest: tuple[int, shm.Segment] | None = None
    for path in shm.list_segments(replica_prefix(run_id)):
        if origin_part not in path.name or (rank is not None and f"-r{rank}-s" not in path.name):
            continue
        try:
            seg = shm.Segment.open(path)
            h = seg.header()
        except (OSError, IntegrityError, ValueError):
            continue
        if h.state == shm.VERIFIED and (newest is None or h.step > newest[0]):
            if newest is not None:
                newest[1].close()
            newest = (h.step, seg)
        else:
            seg.close()
    return newest


@dataclass(frozen=True)
class Record:
    segment: str  # its name in the shm directory
    rank: int
    buffer: int
    origin: str  # the node whose rank wrote it (this node, for its own ranks)
    step: int
    epoch: str
    state: SegmentState | str  # (a str only for an unknown header code)
    data_len: int
    chunk_size: int
    hashes: list[int] | None  # chunk xxh3-64, once the rank staged it (checked table)

    def to_json(self, with_hashes: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not with_hashes:
            out["hashes"] = None if self.hashes is None else len(self.hashes)
        else:
            out["hashes"] = None if self.hashes is None else [f"{h:016x}" for h in self.hashes]
        return out


@dataclass(frozen=True)
class Look:
    """One consistent read-only look at a rank's buffer: its header and, as far as its state
    has them, its manifest (staged or verified) and chunk hash table (verified); ``problem``
    says what could not be read (the header is None when nothing could)."""

    path: Path
    rank: int
    buffer: int
    header: shm.Header | None
    doc: dict[str, Any] | None
    hashes: list[int] | None
    problem: str | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def owner_alive(self) -> bool | None:
        """Whether the launcher that owns the segment still runs (None: no header)."""
        return None if self.header is None else shm.owner_alive(self.header)


@dataclass(frozen=True)
class ChunkMismatch:
    chunk: int
    lo: int  # byte range [lo, hi) of the data region
    hi: int
    expected: int  # xxh3-64 in the segment's hash table
    actual: int  # xxh3-64 of the bytes now


def rank_of(name: str) -> tuple[int, int]:
    """(rank, buffer) from a segment name."""
    r, b = name.rsplit("-", 2)[-2:]
    return int(r[1:]), int(b[1:])


def buffer_of(name: str) -> tuple[int, int] | None:
    """(rank, buffer) when ``name`` is a rank's buffer, None for any other segment (a
    replica)."""
    m = _BUFFER_RE.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _contents(seg: shm.Segment, h: shm.Header) -> tuple[dict[str, Any] | None, list[int] | None]:
    """(manifest, chunk hash table) of a segment as far as its state has them."""
    if h.state not in (shm.STAGED, shm.VERIFIED):
        return None, None
    doc = parse_manifest(seg.manifest_bytes(h))
    try:
        entries(doc)
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"manifest has a malformed tensor table ({e!r})") from e
    if h.state != shm.VERIFIED:
        return doc, None
    return doc, seg.hashes(h)


class Catalog:
    def __init__(self, run_id: str, node_id: str, owner_pid: int) -> None:
        self.run_id = run_id
        self.node_id = node_id
        self.owner_pid = owner_pid
        self.prefix = shm.job_prefix(run_id)
        self._open: dict[str, tuple[int, shm.Segment]] = {}  # name -> (inode, mapping)

    @classmethod
    def reader(cls, run_id: str) -> Catalog:
        """A catalog for a process other than the store, to use read-only (``rank_buffers``,
        ``look``, ``rehash``, ``open_private``): it owns nothing and must adopt nothing, so
        never ask it for ``names`` or ``records``."""
        return cls(run_id, node_id="", owner_pid=0)

    @staticmethod
    def shm_dir() -> Path:
        """The directory that holds the segments (FTRUN_SHM_DIR)."""
        return shm.SHM_DIR

    # -- mappings ---------------------------------------------------------------------------
    def open(self, name: str) -> shm.Segment | None:
        """The mapping of segment ``name`` (re-opened when the file was replaced)."""
        path = shm.SHM_DIR / name
        try:
            st = path.stat()
        except FileNotFoundError:
            self.forget(name)
            return None
        cached = self._open.get(name)
        if cached and cached[0] == st.st_ino and cached[1].mm.size() == st.st_size:
            return cached[1]
        self.forget(name)
        try:
            seg = shm.Segment.open(path)
        except (OSError, IntegrityError, ValueError) as e:
            log.warning("cannot open segment %s: %s", name, e)
            return None
        self._open[name] = (st.st_ino, seg)
        return seg

    def buffer_name(self, rank: int, buffer: int) -> str:
        """The segment of ``rank``'s snapshot buffer ``buffer`` (0 or 1) on this node."""
        return shm.segment_name(self.run_id, rank, buffer)

    @staticmethod
    def open_private(name: str) -> shm.Segment:
        """A mapping of segment ``name`` of the caller's own, for a thread other than the
        store's loop (which may close the catalog's mappings at any time); the caller closes
        it. Raises OSError, IntegrityError or ValueError as ``Segment.open``."""
        return shm.Segment.open(name)

    @staticmethod
    def nbytes(name: str) -> int:
        """The size of segment ``name`` in the shm directory (OSError: it is gone)."""
        return (shm.SHM_DIR / name).stat().st_size

    def unlink_all(self) -> None:
        """Remove this node's segments of the job (the store stops with the job)."""
        for name in self.names():
            try:
                os.unlink(shm.SHM_DIR / name)
            except FileNotFoundError:
                pass

    # -- read-only looks, for a process other than the store ---------------------------------
    def rank_buffers(self) -> list[str]:
        """Every segment of the job's rank buffers on this host, whichever launcher owns it
        (alive or not), sorted; none is adopted."""
        return [path.name for path in shm.list_segments(self.prefix)]

    @staticmethod
    def look(name: str) -> Look | None:
        """One consistent look at rank buffer ``name`` (read again when its rank changes it
        meanwhile), on a mapping of its own; None when ``name`` is no rank's buffer."""
        where = buffer_of(name)
        if where is None:
            return None
        rank, buffer = where
        path = shm.SHM_DIR / name
        try:
            seg = shm.Segment.open(path)
        except (OSError, IntegrityError) as e:
            return Look(path, rank, buffer, None, None, None, f"{path}: unreadable ({e})")
        try:
            for _ in range(LOOK_ATTEMPTS):
                h = seg.header()
                problem = None
                try:
                    doc, hashes = _contents(seg, h)
                except IntegrityError as e:
                    doc, hashes, problem = None, None, f"{path}: {e}"
                if seg.header() == h:  # unchanged while we read: a consistent view
                    return Look(path, rank, buffer, h, doc, hashes, problem)
            return Look(path, rank, buffer, seg.header(), None, None,
                        f"{path}: changed on every read (its rank keeps rewriting it); try "
                        "again")
        finally:
            seg.close()

    @staticmethod
    def rehash(seg: shm.Segment, look: Look,
               progress: Callable[[int], None] | None = None) -> tuple[list[ChunkMismatch], bool]:
        """Re-hash every chunk of ``seg`` (opened with ``open_private``) against the hash table
        of ``look`` with the format's one routine (``verify.hash_chunks``; ``progress`` is told
        each chunk's size): (the chunks that differ, whether the segment stayed as ``look``
        saw it throughout)."""
        assert look.hashes is not None
        h = seg.header()
        with seg.data(h) as data:
            got = verify.hash_chunks(data, h.chunk_size, progress=progress)
        bad = [ChunkMismatch(c, lo, hi, expected, actual)
               for c, ((lo, hi), expected, actual) in enumerate(zip(
                   verify.chunk_ranges(h.data_len, h.chunk_size), look.hashes, got, strict=True))
               if actual != expected]
        return bad, seg.header() == look.header and h == look.header

    def forget(self, name: str) -> None:
        old = self._open.pop(name, None)
        if old:
            old[1].close()

    def close(self) -> None:
        for name in list(self._open):
            self.forget(name)

    # -- what this node holds ---------------------------------------------------------------
    def names(self) -> list[str]:
        """This node's segments of the job: those whose owner is our launcher.

        Several launchers of one job can share a host (and /dev/shm); each store only ever
        touches its own node's buffers. Segments left by a launcher of this job that died (a
        replaced node, a relaunch) are adopted.
        """
        mine = []
        for path in shm.list_segments(self.prefix):
            seg = self.open(path.name)
            if seg is None:
                continue
            h = seg.header()
            if h.owner_pid != self.owner_pid and not shm.owner_alive(h):
                seg.set_state(h.state, owner_pid=self.owner_pid,
                              owner_start=shm.proc_start_ticks(self.owner_pid))
                log.info("adopted %s (step %d) from dead launcher %d", path.name, h.step,
                         h.owner_pid)
                h = seg.header()
            if h.owner_pid == self.owner_pid:
                mine.append(path.name)
        return mine

    def record(self, name: str) -> Record | None:
        seg = self.open(name)
        if seg is None:
            return None
        try:
            h = seg.header()
            hashes = seg.hashes(h) if h.state in (shm.STAGED, shm.VERIFIED) and h.hashes_xxh3 \
                else None
        except IntegrityError as e:
            log.debug("%s: %s", name, e)
            hashes = None
            h = seg.header()
        rank, buffer = rank_of(name)
        return Record(name, rank, buffer, self.node_id, h.step, h.epoch, h.state_name,
                      h.data_len, h.chunk_size, hashes)

    def records(self, rank: int | None = None) -> list[Record]:
        out = []
        for name in self.names():
            if rank is not None and rank_of(name)[0] != rank:
                continue
            rec = self.record(name)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: (r.rank, r.buffer))

    def held_steps(self) -> dict[int, list[int]]:
        """rank -> the steps its buffers hold verified, for this node's ranks."""
        held: dict[int, list[int]] = {}
        for rec in self.records():
            steps = held.setdefault(rec.rank, [])
            if rec.state == SegmentState.VERIFIED:
                steps.append(rec.step)
        return {r: sorted(held[r]) for r in sorted(held)}
