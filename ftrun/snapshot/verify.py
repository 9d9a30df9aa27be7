"""The one verification routine: xxh3-64 per fixed-size chunk of a snapshot's data region.

A rank hashes each chunk as soon as the tensors in it are copied (``ChunkHasher``), so the
hashes cover exactly the bytes it wrote. Every later reader — the store's persist copy,
``restore()``, ``ftrun inspect --verify`` — re-hashes against that table with ``check`` and
names what is wrong: the chunk, its byte range, and the tensors in it.

xxhash releases the GIL while it hashes (measured: another Python thread keeps running during
a single 1 GiB digest), so chunks are hashed on plain threads, in parallel.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import xxhash

from ftrun.errors import IntegrityError, ProtocolError
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import entries, parse_manifest

# Chunks per shard_read_request (16 MiB of 4 MiB chunks): the shard service's limit, which
# readers keep to.
READ_CHUNKS_MAX = 4


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """A chunk hash table as it travels in a frame: little-endian u64s."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(blob: bytes | memoryview) -> list[int]:
    if len(blob) % 8:
        raise ProtocolError(f"a chunk hash table of {len(blob)} bytes (not a multiple of 8)")
    return list(struct.unpack(f"<{len(blob) // 8}Q", blob))


def chunk_ranges(data_len: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(off, min(off + chunk_size, data_len)) for off in range(0, data_len, chunk_size)]


def hash_chunks(data: memoryview, chunk_size: int, pool: Executor | None = None,
                progress: Callable[[int], None] | None = None) -> list[int]:
    """xxh3-64 of every chunk of ``data``, on ``pool``'s threads when given; ``progress`` is
    told each chunk's size as its hash comes in."""
    parts = [data[a:b] for a, b in chunk_ranges(len(data), chunk_size)]
    if pool is None or len(parts) < 2:
        hashes: Iterable[int] = map(xxhash.xxh3_64_intdigest, parts)
    else:
        hashes = pool.map(xxhash.xxh3_64_intdigest, parts)
    out = []
    for part, digest in zip(parts, hashes, strict=True):
        out.append(digest)
        if progress is not None:
            progress(len(part))
    return out


def bad_chunks(data: memoryview, chunk_size: int, want: Sequence[int],
               pool: Executor | None = None) -> list[int]:
    """Indices of the chunks of ``data`` that do not hash to ``want``."""
    if len(want) != shm.chunk_count(len(data), chunk_size):
        raise IntegrityError(f"{len(want)} chunk hashes for {len(data)} bytes in chunks of "
                             f"{chunk_size}")
    got = hash_chunks(data, chunk_size, pool)
    return [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def tensors_in(doc: dict[str, Any], lo: int, hi: int) -> list[str]:
    """Manifest keys of the tensors whose bytes overlap [lo, hi)."""
    return [e.key for e in entries(doc) if e.nbytes and e.offset < hi and e.offset + e.nbytes > lo]


def describe(doc: dict[str, Any], chunk_size: int, bad: list[int], data_len: int) -> str:
    lo, hi = bad[0] * chunk_size, min((bad[0] + 1) * chunk_size, data_len)
    keys = tensors_in(doc, lo, hi)
    where = f"tensor {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "") \
        if keys else "padding between tensors"
    return (f"hash mismatch in {len(bad)} chunk(s) of {chunk_size >> 10} KiB, first chunk "
            f"{bad[0]} (bytes {lo}-{hi}: {where})")


def check(seg: shm.Segment, pool: Executor | None = None,
          states: tuple[int, ...] = (shm.VERIFIED,)) -> tuple[bool, str]:
    """Re-hash a segment's data against its chunk table: (ok, reason)."""
    try:
        h = seg.header()
        if h.state not in states:
            return False, f"state {h.state_name}"
        doc = parse_manifest(seg.manifest_bytes(h))
        want = seg.hashes(h)
        bad = bad_chunks(seg.data(h), h.chunk_size, want, pool)
    except (IntegrityError, ValueError, KeyError) as e:
        return False, str(e)
    if bad:
        return False, describe(doc, h.chunk_size, bad, h.data_len)
    return True, ""


def check_copy(data: memoryview | bytes, doc: dict[str, Any], chunk_size: int,
               want: Sequence[int], what: str, pool: Executor | None = None) -> None:
    """Raise IntegrityError, naming the chunk and tensors, if a copy of a data region does
    not match its chunk hashes (the store checks what it copied before it writes it)."""
    view = memoryview(data)
    bad = bad_chunks(view, chunk_size, want, pool)
    if bad:
        raise IntegrityError(f"{what}: {describe(doc, chunk_size, bad, len(view))}")


def tensor_hashes(doc: dict[str, Any], data: memoryview | bytes) -> list[int]:
    """xxh3-64 of each tensor (the unit of the on-disk checkpoint's hash file), from a data
    region that was checked against its chunk hashes."""
    view = memoryview(data)
    return [xxhash.xxh3_64_intdigest(view[e.offset:e.offset + e.nbytes]) for e in entries(doc)]


class ChunkHasher:
    """Hashes each chunk of a data region as soon as every tensor in it has been copied.

    The copying thread calls ``copied(i)`` for each tensor (in any order); a chunk goes to the
    pool once the last tensor overlapping it is in. ``finish()`` hashes what is left (chunks of
    padding only) and returns the table.
    """

    def __init__(self, data: memoryview, spans: list[tuple[int, int]], chunk_size: int,
                 pool: Executor) -> None:
        self._data = data
        self._chunk = chunk_size
        self._pool = pool
        n = shm.chunk_count(len(data), chunk_size)
        self.hashes = [0] * n
        self._left = [0] * n  # tensors still to copy, per chunk
        self._chunks_of: list[range] = []
        for offset, nbytes in spans:
            r = range(offset // chunk_size, -(-(offset + nbytes) // chunk_size)) if nbytes \
                else range(0)
            self._chunks_of.append(r)
            for c in r:
                self._left[c] += 1
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._submitted = [False] * n

    def _submit(self, c: int) -> None:
        self._submitted[c] = True
        self._futures.append(self._pool.submit(self._digest, c))

    def _digest(self, c: int) -> None:
        lo = c * self._chunk
        self.hashes[c] = xxhash.xxh3_64_intdigest(self._data[lo:lo + self._chunk])

    def copied(self, i: int) -> None:
        with self._lock:
            for c in self._chunks_of[i]:
                self._left[c] -= 1
                if self._left[c] == 0:
                    self._submit(c)

    def finish(self) -> list[int]:
        with self._lock:
            for c, left in enumerate(self._left):
                if left == 0 and not self._submitted[c]:
                    self._submit(c)
                elif left:
                    raise IntegrityError(f"chunk {c} hashed before all its tensors were copied")
        for f in self._futures:
            f.result()
        return self.hashes
