"""Named shared-memory segments that hold one rank's snapshot buffer.

Each rank owns two segments (``b0``/``b1``) in ``/dev/shm``, private to the user (0600).
They are named after the job and the rank, so they outlive a crash of the rank *and* of the
node's store: whoever comes next opens them by name. Layout::

    [0, 4096)             header: magic, version, state, step, epoch, sizes, owner, hashes' hash
    [4096, 4096+M)        manifest JSON (written by the rank when it stages)
    [.., ..+8*C)          xxh3-64 of every fixed-size chunk of the data region, in order
    [data_off, ..)        tensor bytes, each 64-byte aligned

The chunk hashes are taken by the rank as it copies (ftrun.snapshot.verify), so they cover
exactly what it wrote; every later reader checks against them. States: EMPTY -> WRITING
(rank copying) -> STAGED (copy complete, manifest and chunk hashes written) -> VERIFIED (the
store checked the table and told the coordinator). A segment found in WRITING is torn:
never loaded.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ftrun import knobs
from ftrun.errors import ConfigError, IntegrityError
from ftrun.snapshot.api import SegmentState

SHM_DIR = Path(knobs.SHM_DIR.get())
MAGIC = b"FTRUNSN1"
VERSION = 2
CHUNK_BYTES = 4 << 20  # the unit of hashing and verification (recorded per segment)
HEADER_SIZE = 4096
ALIGN = 64
PAGE = mmap.PAGESIZE

EMPTY, WRITING, STAGED, VERIFIED = 0, 1, 2, 3
STATE_NAMES = {EMPTY: SegmentState.EMPTY, WRITING: SegmentState.WRITING, STAGED: SegmentState.STAGED,
               VERIFIED: SegmentState.VERIFIED}

# magic, version, state, step, epoch(16s), manifest_len, manifest_cap, n_tensors, hash_off,
# data_off, data_len, capacity, manifest_xxh3, hashes_xxh3, owner_pid, owner_start, staged_at,
# chunk_size, hash_slots
_HEADER = struct.Struct("<8sIIq16sQQQQQQQQQQQdQQ")
TORN_READ_RETRIES = 3  # a header that fails its checks is read again this often (see header())
TORN_READ_PAUSE_S = 0.001


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def job_tag(run_id: str) -> str:
    """A short, filesystem-safe tag unique to the run id (and the user)."""
    digest = hashlib.sha1(f"{os.getuid()}:{run_id}".encode()).hexdigest()[:10]
    safe = re.sub(r"[^A-Za-z0-9]", "", run_id)[:16]
    return f"{safe}-{digest}"


def segment_name(run_id: str, rank: int, buffer: int) -> str:
    return f"ftrun-{os.getuid()}-{job_tag(run_id)}-r{rank}-b{buffer}"


def job_prefix(run_id: str) -> str:
    return f"ftrun-{os.getuid()}-{job_tag(run_id)}-"


def proc_start_ticks(pid: int) -> int:
    """Start time of a process in clock ticks since boot (0 if unknown): tells PID reuse apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rpartition(")")[2].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass
class Header:
    state: int
    step: int
    epoch: str
    manifest_len: int
    manifest_cap: int
    n_tensors: int
    hash_off: int
    data_off: int
    data_len: int
    capacity: int
    manifest_xxh3: int
    hashes_xxh3: int
    owner_pid: int
    owner_start: int
    staged_at: float
    chunk_size: int
    hash_slots: int  # room in the hash table (chunks of the largest data region it fits)

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, f"unknown({self.state})")

    @property
    def n_chunks(self) -> int:
        """Chunks of the current data region (one hash each)."""
        return chunk_count(self.data_len, self.chunk_size)


def chunk_count(data_len: int, chunk_size: int) -> int:
    return -(-data_len // chunk_size)


def layout_for(manifest_cap: int, data_len: int,
               chunk_size: int = CHUNK_BYTES) -> tuple[int, int, int]:
    """(hash_off, data_off, capacity) for a segment of the given sizes."""
    hash_off = align(HEADER_SIZE + manifest_cap, 8)
    data_off = align(hash_off + 8 * max(1, chunk_count(data_len, chunk_size)), PAGE)
    return hash_off, data_off, align(data_off + data_len, PAGE)


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_capacity(needed: int, what: str) -> None:
    """Refuse up front, with the fix, when /dev/shm or RAM cannot hold ``needed`` bytes.

    Writing past what tmpfs can hold would end in SIGBUS halfway through a copy.
    """
    free = shm_free_bytes()
    total = shutil.disk_usage(SHM_DIR).total
    if needed > free:
        raise ConfigError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free (of {total / 2**20:.0f} MiB) but {what} "
            f"needs {needed / 2**20:.0f} MiB (two buffers per rank). Enlarge it: Docker "
            f"`--shm-size={max(1, -(-needed * 2 // 2**30))}g`, Kubernetes an emptyDir with "
            "medium: Memory at /dev/shm, or `mount -o remount,size=...G /dev/shm`."
        )
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if needed > available:
        raise ConfigError(
            f"{what} needs {needed / 2**20:.0f} MiB of shared memory but only "
            f"{available / 2**20:.0f} MiB of RAM is available; snapshot less state "
            "(e.g. fewer ranks per node) or use a host with more memory."
        )


class Segment:
    """One mapped snapshot buffer."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.mm = mm

    @property
    def name(self) -> str:
        return self.path.name

    # -- life cycle ---------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, manifest_cap: int, n_tensors: int, data_len: int,
               owner_pid: int, chunk_size: int = CHUNK_BYTES) -> Segment:
        """Create (or re-create, larger) the segment and touch every page now.

        Pre-faulting costs once at creation: first-touch page faults make a copy into fresh
        shared memory several times slower than into touched pages.
        """
        hash_off, data_off, capacity = layout_for(manifest_cap, data_len, chunk_size)
        final = SHM_DIR / name
        # Built under a hidden name and renamed when complete: nobody opens a half-made one.
        path = SHM_DIR / f".{name}.{os.getpid()}.tmp"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, capacity)  # reserve tmpfs pages: no SIGBUS later
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                fd = -1
                raise ConfigError(
                    f"cannot reserve {capacity / 2**20:.0f} MiB in {SHM_DIR} for {name}: "
                    f"{e.strerror}. Enlarge /dev/shm (Docker: --shm-size)."
                ) from e
            mm = mmap.mmap(fd, capacity)
        finally:
            if fd >= 0:
                os.close(fd)
        _prefault(mm, capacity)
        seg = cls(final, mm)
        seg.write_header(Header(
            state=EMPTY, step=-1, epoch="", manifest_len=0, manifest_cap=manifest_cap,
            n_tensors=n_tensors, hash_off=hash_off, data_off=data_off, data_len=data_len,
            capacity=capacity, manifest_xxh3=0, hashes_xxh3=0, owner_pid=owner_pid,
            owner_start=proc_start_ticks(owner_pid), staged_at=0.0, chunk_size=chunk_size,
            hash_slots=max(1, chunk_count(data_len, chunk_size)),
        ))
        os.replace(path, final)
        return seg

    @classmethod
    def open(cls, name_or_path: str | Path) -> Segment:
        path = Path(name_or_path)
        if not path.is_absolute():
            path = SHM_DIR / path
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise IntegrityError(f"{path} is {size} bytes: not an ftrun snapshot segment")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = cls(path, mm)
        seg.header()  # validates magic and version
        return seg

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # views into the buffer still alive; the mapping goes with the process

    def unlink(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- header -------------------------------------------------------------------------
    def header(self) -> Header:
        # Another process may be writing the header as it is read. A write lands in one copy
        # (write_header), so a read between its bytes is short-lived: read again before
        # calling the header corrupt.
        for _ in range(TORN_READ_RETRIES):
            try:
                return self._read_header()
            except IntegrityError:
                time.sleep(TORN_READ_PAUSE_S)
        return self._read_header()

    def _read_header(self) -> Header:
        raw = _HEADER.unpack_from(self.mm, 0)
        if raw[0] != MAGIC:
            raise IntegrityError(f"{self.path}: bad magic {raw[0]!r}; not an ftrun snapshot")
        if raw[1] != VERSION:
            raise IntegrityError(f"{self.path}: layout version {raw[1]}, this ftrun reads {VERSION}")
        epoch = raw[4].rstrip(b"\0").decode(errors="replace")
        h = Header(raw[2], raw[3], epoch, *raw[5:])
        if h.chunk_size <= 0 or h.data_off + h.data_len > len(self.mm):
            raise IntegrityError(f"{self.path}: corrupt header (chunk size {h.chunk_size}, data "
                                 f"{h.data_off}+{h.data_len} in {len(self.mm)} bytes)")
        return h

    def write_header(self, h: Header) -> None:
        # Packed apart, then copied in one go: struct's pack_into clears the whole record
        # before filling it field by field, so a reader in another process (the store, a
        # restore, inspect) could find a header half zeros.
        self.mm[:_HEADER.size] = _HEADER.pack(
            MAGIC, VERSION, h.state, h.step, h.epoch.encode()[:16].ljust(16, b"\0"),
            h.manifest_len, h.manifest_cap, h.n_tensors, h.hash_off, h.data_off, h.data_len,
            h.capacity, h.manifest_xxh3, h.hashes_xxh3, h.owner_pid, h.owner_start, h.staged_at,
            h.chunk_size, h.hash_slots,
        )

    def set_state(self, state: int, **changes: object) -> Header:
        h = self.header()
        h.state = state
        for key, value in changes.items():
            setattr(h, key, value)
        self.write_header(h)
        return h

    # -- regions ------------------------------------------------------------------------
    def data(self, h: Header | None = None) -> memoryview:
        h = h or self.header()
        return memoryview(self.mm)[h.data_off:h.data_off + h.data_len]

    def write_manifest(self, blob: bytes) -> int:
        h = self.header()
        if len(blob) > h.manifest_cap:
            raise IntegrityError(f"manifest of {len(blob)} bytes exceeds its {h.manifest_cap}-byte slot")
        self.mm[HEADER_SIZE:HEADER_SIZE + len(blob)] = blob
        return xxhash.xxh3_64_intdigest(blob)

    def manifest_bytes(self, h: Header | None = None) -> bytes:
        h = h or self.header()
        if h.manifest_len > h.manifest_cap:
            raise IntegrityError(f"{self.path}: manifest length {h.manifest_len} exceeds its slot")
        blob = bytes(self.mm[HEADER_SIZE:HEADER_SIZE + h.manifest_len])
        if xxhash.xxh3_64_intdigest(blob) != h.manifest_xxh3:
            raise IntegrityError(f"{self.path}: manifest hash mismatch")
        return blob

    def write_hashes(self, hashes: list[int]) -> int:
        """Write the chunk hashes of the current data region; returns the table's own hash."""
        h = self.header()
        if len(hashes) != h.n_chunks or len(hashes) > h.hash_slots:
            raise IntegrityError(f"{len(hashes)} hashes for {h.n_chunks} chunks of "
                                 f"{h.chunk_size} bytes ({h.hash_slots} slots)")
        blob = struct.pack(f"<{len(hashes)}Q", *hashes)
        self.mm[h.hash_off:h.hash_off + len(blob)] = blob
        return xxhash.xxh3_64_intdigest(blob)

    def hashes(self, h: Header | None = None) -> list[int]:
        """The chunk hashes, checked against the table's own hash."""
        h = h or self.header()
        n = h.n_chunks
        if n > h.hash_slots:
            raise IntegrityError(f"{self.path}: {n} chunks but room for {h.hash_slots} hashes")
        blob = bytes(self.mm[h.hash_off:h.hash_off + 8 * n])
        if xxhash.xxh3_64_intdigest(blob) != h.hashes_xxh3:
            raise IntegrityError(f"{self.path}: hash table does not match its own hash")
        return list(struct.unpack(f"<{n}Q", blob))


def _prefault(mm: mmap.mmap, size: int) -> None:
    chunk = bytes(1 << 20)
    for off in range(0, size, len(chunk)):
        n = min(len(chunk), size - off)
        mm[off:off + n] = chunk[:n]


def list_segments(prefix: str) -> list[Path]:
    try:
        return sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def owner_alive(h: Header) -> bool:
    if h.owner_pid <= 0:
        return False
    try:
        os.kill(h.owner_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    start = proc_start_ticks(h.owner_pid)
    return start == 0 or h.owner_start == 0 or start == h.owner_start


def _other_version(path: Path) -> bool:
    """An ftrun segment of another layout version."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError:
        return False
    return len(head) == 12 and head[:8] == MAGIC and struct.unpack("<I", head[8:])[0] != VERSION


def clean_leftovers(keep_prefix: str | None = None) -> list[str]:
    """Remove this user's segments whose owning launcher is gone. Returns the names removed.

    A segment is only removed when it is ours (name carries our uid), is not the current
    job's, and its recorded owner process no longer exists (PID reuse is told apart by the
    process start time).
    """
    removed = []
    for path in list_segments(f"ftrun-{os.getuid()}-"):
        if keep_prefix and path.name.startswith(keep_prefix):
            continue
        if _other_version(path):
            # Written by another ftrun release (a job of an older or newer install on the
            # same host): its owner cannot be read here, so it is left alone.
            continue
        try:
            seg = Segment.open(path)
            try:
                alive = owner_alive(seg.header())
            finally:
                seg.close()
        except (OSError, IntegrityError, ValueError):
            alive = False
        if not alive:
            try:
                os.unlink(path)
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed
