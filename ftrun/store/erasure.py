"""Erasure coding of snapshot shards (REFT): parity for a stripe of data slices, and any lost
slices rebuilt from the stripe's survivors, chunk by chunk, every chunk checked against its
xxh3-64 hash before it is used and after it is rebuilt.

Terms (see :func:`ftrun.coordinator.placement.erasure_placement` for who holds what):

- a node's bytes (one shard's data region) are cut into ``K`` **slices**: chunk ``c`` (the
  store's fixed-size hashing unit, ``CHUNK_BYTES``) goes to slice ``c mod K``, so a slice is a
  run of whole chunks, the last one possibly partial, and its chunk hashes are the node's own;
- a **stripe** is ``K`` data slices from ``K`` nodes (positions ``0 .. K-1``) and ``M``
  parity fragments (positions ``K .. K+M-1``); chunk ``s`` of every parity fragment is coded
  from chunk ``s`` of each slice, the shorter ones zero-padded to the longest (the padding is
  not stored; it follows from the slice lengths, which every parity fragment records);
- a parity fragment records, in its :class:`StripeInfo`, the lengths of the stripe's data
  slices and the chunk hashes of every position, so that the survivors can check each piece
  they use and each piece they rebuild without anything from the lost nodes.

A piece that does not match its hash is never used: it counts as lost, and the chunk is
decoded from other pieces if ``K`` verified ones remain, or refused with an error naming every
piece and why it could not be used. A rebuilt piece that does not match its recorded hash is
refused too. The arithmetic is the library's (pyeclib over liberasurecode, backend ISA-L's
Reed-Solomon with a Cauchy matrix: every ``K`` of ``K + M`` fragments decode, for every ``K``
and ``M``); ftrun only lays bytes out and checks them.

pyeclib holds the GIL while it codes: chunks are coded in units of ``UNIT_BYTES`` so that one
call stays short (well under a millisecond) and other threads of the process run between calls
(measured here: a pure-Python thread beside a coding loop kept 0.17 of its speed with calls of
4 x 4 MiB, 0.61 with calls of 4 x 64 KiB). The store's integration should still code off its
message loop's thread, or in a process of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import xxhash

from ftrun.errors import ConfigError, IntegrityError, RestoreError
from ftrun.snapshot.segment import CHUNK_BYTES, chunk_count

if TYPE_CHECKING:
    from ftrun.coordinator.placement import ErasurePlacement

log = logging.getLogger(__name__)

# ISA-L Reed-Solomon, Cauchy matrix: every K of K + M fragments decode, for every K and M (ISA-L
# documents its Vandermonde matrix as not invertible for some sub-matrices at larger K and M).
# Every node of a job must code with the same backend: it is recorded in every parity fragment
# and checked before decoding.
BACKEND = "isa_l_rs_cauchy"
# Bytes per data piece in one library call (see the module docstring). Measured here
# (bench/erasure.py, units): 16-256 KiB within the machine's noise of each other, 1 MiB and more
# several times slower (the library allocates its fragments anew on every call); at 64 KiB a
# call lasts ~0.3 ms at ec:4+2.
UNIT_BYTES = 64 << 10

Buffer = Union[bytes, bytearray, memoryview]
# A column (a data slice or a parity fragment): one contiguous buffer, or its chunks in order.
Column = Union[Buffer, Sequence[Buffer]]

_ZEROS = bytes(max(UNIT_BYTES, CHUNK_BYTES))


def _zeros(n: int) -> memoryview:
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else memoryview(bytes(n))


class Codec:
    """An erasure code of ``k`` data and ``m`` parity fragments: parity for ``k`` pieces of one
    width, and pieces rebuilt from any ``k`` others. One per thread: the library keeps state
    per handle."""

    def __init__(self, k: int, m: int, *, backend: str = BACKEND, unit: int = UNIT_BYTES) -> None:
        from pyeclib.ec_iface import VALID_EC_TYPES, ECDriver  # deferred: a C extension

        if k < 1 or m < 1:
            raise ConfigError(f"an erasure code needs k >= 1 and m >= 1, got {k}+{m}")
        if unit < 1:
            raise ConfigError(f"the coding unit must be >= 1 byte, got {unit}")
        if backend not in VALID_EC_TYPES:
            raise ConfigError(f"erasure-coding backend {backend!r} is not available here "
                              f"(available: {', '.join(VALID_EC_TYPES) or 'none'}); reinstall "
                              "ftrun's pyeclib wheel, which bundles liberasurecode and ISA-L")
        self.k, self.m, self.backend, self.unit = k, m, backend, unit
        self._driver = ECDriver(k=k, m=m, ec_type=backend)
        self._headers: dict[int, list[bytes]] = {}
        self._check_systematic()

    def _check_systematic(self) -> None:
        """ftrun keeps data pieces where they are, stores parity payloads only and gives the
        library back its own headers to decode: that needs a systematic code whose fragments
        are a header that does not depend on the bytes, then the piece itself. Check it once."""
        width = 97  # odd on purpose: no alignment helps
        pattern = bytes((i * 31 + 7) % 251 for i in range(self.k * width))
        frags = self._driver.encode(pattern)
        ok = len(frags) == self.k + self.m and all(
            len(f) > width and bytes(f[len(f) - width:]) == pattern[j * width:(j + 1) * width]
            for j, f in enumerate(frags[:self.k])) and [
            bytes(f[:len(f) - width]) for f in frags] == self._header(width)
        if not ok:
            raise ConfigError(f"the erasure-coding library's {self.backend} does not lay out "
                              "fragments as ftrun expects (systematic; a header independent of "
                              "the bytes, then the payload); install the pyeclib version "
                              "pinned in ftrun's pyproject.toml")

    def _header(self, width: int) -> list[bytes]:
        """The library's fragment headers for pieces of ``width`` bytes, by position. They do
        not depend on the bytes coded (no checksum is configured), so one encode of zeros
        gives them; they let decode take bare payloads."""
        got = self._headers.get(width)
        if got is None:
            frags = self._driver.encode(bytes(self.k * width))
            got = [bytes(f[:len(f) - width]) for f in frags]
            if len(self._headers) >= 64:  # a few widths recur (the unit, last units)
                self._headers.clear()
            self._headers[width] = got
        return got

    def parity(self, pieces: Sequence[Buffer], width: int,
               into: Sequence[memoryview]) -> None:
        """The ``m`` parity pieces of ``k`` data pieces, each zero-padded to ``width``, written
        into ``into`` (``m`` writable views of ``width`` bytes)."""
        if len(pieces) != self.k or len(into) != self.m:
            raise ValueError(f"{len(pieces)} data pieces and {len(into)} outputs for a code of "
                             f"{self.k}+{self.m}")
        views = [memoryview(p).cast("B") for p in pieces]
        for off in range(0, width, self.unit):
            w = min(self.unit, width - off)
            parts: list[Buffer] = []
            for v in views:
                seg = v[off:off + w]
                parts.append(seg)
                if len(seg) < w:
                    parts.append(_zeros(w - len(seg)))
            frags = self._driver.encode(b"".join(parts))
            for t in range(self.m):
                f = frags[self.k + t]
                into[t][off:off + w] = memoryview(f)[len(f) - w:]

    def rebuild(self, pieces: Mapping[int, Buffer], into: Mapping[int, memoryview],
                width: int) -> None:
        """The pieces at the positions of ``into`` (writable views of ``width`` bytes) from
        exactly ``k`` others (positions ``0 .. k+m-1``), each zero-padded to ``width``. The
        caller verifies what goes in and what comes out."""
        if len(pieces) != self.k:
            raise ValueError(f"{len(pieces)} pieces given, a code of k={self.k} decodes from "
                             f"exactly {self.k}")
        views = {p: memoryview(b).cast("B") for p, b in pieces.items()}
        for off in range(0, width, self.unit):
            w = min(self.unit, width - off)
            headers = self._header(w)
            frags = []
            for p, v in views.items():
                seg = v[off:off + w]
                frags.append(b"".join([headers[p], seg, _zeros(w - len(seg))]))
            # one position at a time: ISA-L then computes only that row (measured: twice
            # the speed of decoding every data fragment when one is lost)
            for p, out in into.items():
                (f,) = self._driver.reconstruct(frags, [p])
                out[off:off + w] = memoryview(f)[len(f) - w:]


def _piece_length(total: int, s: int, chunk_size: int) -> int:
    return max(0, min(chunk_size, total - s * chunk_size))


@dataclass(frozen=True)
class StripeInfo:
    """What every parity fragment of one stripe records: the code, the data slices' lengths
    and the chunk hashes of every position (``k`` data slices, then ``m`` parity fragments).

    Chunk ``s`` of the stripe is ``width(s)`` bytes wide: the longest data piece at ``s``
    (the chunk size, except at the last chunk). Data pieces shorter than that are coded with
    zero padding (``padding(j, s)`` bytes); a parity fragment is laid out like a shard, in
    chunks of ``chunk_size`` with the last one partial."""

    k: int
    m: int
    chunk_size: int
    unit: int
    backend: str
    lengths: tuple[int, ...]
    hashes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.lengths) != self.k or len(self.hashes) != self.k + self.m:
            raise IntegrityError(f"stripe info of ec:{self.k}+{self.m} with "
                                 f"{len(self.lengths)} data lengths and {len(self.hashes)} "
                                 "hash tables")
        for p in range(self.k + self.m):
            want = chunk_count(self.length(p), self.chunk_size)
            if len(self.hashes[p]) != want:
                raise IntegrityError(f"stripe position {p}: {len(self.hashes[p])} chunk hashes "
                                     f"for {self.length(p)} bytes in chunks of {self.chunk_size}")

    @property
    def chunks(self) -> int:
        return max((chunk_count(n, self.chunk_size) for n in self.lengths), default=0)

    def width(self, s: int) -> int:
        return max(_piece_length(n, s, self.chunk_size) for n in self.lengths)

    def length(self, position: int) -> int:
        """Bytes of the column at ``position`` (a data slice or a parity fragment)."""
        if position < self.k:
            return self.lengths[position]
        c = self.chunks
        return 0 if c == 0 else (c - 1) * self.chunk_size + self.width(c - 1)

    def piece_length(self, position: int, s: int) -> int:
        return _piece_length(self.length(position), s, self.chunk_size)

    def padding(self, position: int, s: int) -> int:
        """Zero bytes appended to the data piece at ``position`` to code chunk ``s``."""
        return self.width(s) - self.piece_length(position, s)

    def key(self) -> int:
        """A digest of this info: the parity fragments of one stripe must agree on it."""
        h = xxhash.xxh3_64()
        h.update(repr((self.k, self.m, self.chunk_size, self.unit, self.backend, self.lengths,
                       self.hashes)).encode())
        return h.intdigest()


@dataclass(frozen=True)
class ParityFragment:
    """Parity fragment ``index`` (position ``k + index``) of a stripe, with the stripe's info."""

    info: StripeInfo
    index: int
    data: Buffer  # the encoder's output buffer (a view when it was given one)

    @property
    def position(self) -> int:
        return self.info.k + self.index


def _chunk(column: Column, s: int, chunk_size: int) -> memoryview | None:
    """Chunk ``s`` of a column given whole or as chunks; None where the column has no such
    chunk."""
    if isinstance(column, (bytes, bytearray, memoryview)):
        v = memoryview(column).cast("B")
        return v[s * chunk_size:(s + 1) * chunk_size] if s * chunk_size < len(v) else None
    return memoryview(column[s]).cast("B") if s < len(column) else None


def chunk_hashes(data: Column, chunk_size: int = CHUNK_BYTES) -> list[int]:
    """xxh3-64 of every chunk of a column (the store's per-chunk hash)."""
    out = []
    s = 0
    while (piece := _chunk(data, s, chunk_size)) is not None and len(piece):
        out.append(xxhash.xxh3_64_intdigest(piece))
        s += 1
    return out


def _column_length(column: Column) -> int:
    if isinstance(column, (bytes, bytearray, memoryview)):
        return memoryview(column).nbytes
    return sum(memoryview(c).nbytes for c in column)


class Encoder:
    """Computes a stripe's ``m`` parity fragments chunk by chunk, as the chunks of its data
    slices arrive (in any order, e.g. as each node's shard is verified).

    Each chunk is checked against its recorded hash before it is kept; chunk ``s`` of the
    parity is coded as soon as every slice's chunk ``s`` is in, and the data pieces are then
    let go. A piece given to :meth:`add` must not change until its chunk is coded (``add``
    returns True when it coded one). The parity is written into ``into`` when given (``m``
    writable buffers of at least :meth:`parity_length` bytes, e.g. pre-faulted shared memory),
    else into new ones."""

    def __init__(self, codec: Codec, lengths: Sequence[int], hashes: Sequence[Sequence[int]],
                 chunk_size: int = CHUNK_BYTES,
                 into: Sequence[bytearray | memoryview] | None = None) -> None:
        if len(lengths) != codec.k or len(hashes) != codec.k:
            raise ValueError(f"{len(lengths)} lengths and {len(hashes)} hash tables for "
                             f"k={codec.k} data slices")
        self._codec = codec
        self._chunk_size = chunk_size
        self._lengths = tuple(lengths)
        self._hashes = tuple(tuple(h) for h in hashes)
        # info without the parity hashes yet: used for the geometry only
        self._shape = StripeInfo(codec.k, codec.m, chunk_size, codec.unit, codec.backend,
                                 self._lengths, (*self._hashes, *self._parity_shape()))
        chunks = self._shape.chunks
        size = self.parity_length
        if into is None:
            into = [bytearray(size) for _ in range(codec.m)]
        if len(into) != codec.m or any(memoryview(b).nbytes < size for b in into):
            raise ValueError(f"parity goes into {codec.m} buffers of {size} bytes, got "
                             f"{[memoryview(b).nbytes for b in into]}")
        self._out = [memoryview(b).cast("B")[:size] for b in into]
        self._parity_hashes = [[0] * chunks for _ in range(codec.m)]
        # chunk s -> the data pieces still awaited / already in
        self._awaited = {s: {j for j in range(codec.k) if self._shape.piece_length(j, s)}
                         for s in range(chunks)}
        self._pieces: dict[int, dict[int, memoryview]] = {s: {} for s in range(chunks)}

    def _parity_shape(self) -> list[tuple[int, ...]]:
        chunks = max((chunk_count(n, self._chunk_size) for n in self._lengths), default=0)
        return [(0,) * chunks for _ in range(self._codec.m)]

    @property
    def parity_length(self) -> int:
        """Bytes of each parity fragment."""
        return self._shape.length(self._codec.k)

    @property
    def complete(self) -> bool:
        return not self._awaited

    def missing(self) -> list[tuple[int, int]]:
        """(slice position, chunk) pairs still awaited."""
        return sorted((j, s) for s, js in self._awaited.items() for j in js)

    def add(self, position: int, s: int, piece: Buffer) -> bool:
        """Chunk ``s`` of the data slice at ``position``. Returns whether parity chunk ``s``
        was coded by this call. A chunk given again (after a resend) is checked and ignored."""
        info = self._shape
        if not 0 <= position < info.k:
            raise ValueError(f"data position {position} outside 0..{info.k - 1}")
        want = info.piece_length(position, s)
        if not 0 <= s < info.chunks or want == 0:
            raise ValueError(f"data slice {position} has no chunk {s} "
                             f"({info.lengths[position]} bytes)")
        view = memoryview(piece).cast("B")
        if len(view) != want:
            raise IntegrityError(f"data slice {position} chunk {s}: {len(view)} bytes, "
                                 f"expected {want}; not coded")
        got = xxhash.xxh3_64_intdigest(view)
        if got != self._hashes[position][s]:
            raise IntegrityError(f"data slice {position} chunk {s}: xxh3 {got:#018x} != "
                                 f"recorded {self._hashes[position][s]:#018x}; not coded")
        awaited = self._awaited.get(s)
        if awaited is None or position not in awaited:
            return False
        awaited.discard(position)
        self._pieces[s][position] = view
        if awaited:
            return False
        self._code(s)
        return True

    def _code(self, s: int) -> None:
        info, c = self._shape, self._chunk_size
        width = info.width(s)
        got = self._pieces.pop(s)
        pieces = [got.get(j, _zeros(0)) for j in range(info.k)]
        outs = [out[s * c:s * c + width] for out in self._out]
        self._codec.parity(pieces, width, outs)
        for t, out in enumerate(outs):
            self._parity_hashes[t][s] = xxhash.xxh3_64_intdigest(out)
        del self._awaited[s]

    def fragments(self) -> list[ParityFragment]:
        """The ``m`` parity fragments, once every chunk is coded."""
        if self._awaited:
            left = self.missing()
            raise RestoreError(f"stripe parity incomplete: {len(left)} data chunks not given "
                               f"yet (first: slice {left[0][0]} chunk {left[0][1]})")
        info = StripeInfo(self._codec.k, self._codec.m, self._chunk_size, self._codec.unit,
                          self._codec.backend, self._lengths,
                          (*self._hashes, *(tuple(h) for h in self._parity_hashes)))
        return [ParityFragment(info, t, out) for t, out in enumerate(self._out)]


def encode(codec: Codec, slices: Sequence[Column], chunk_size: int = CHUNK_BYTES,
           hashes: Sequence[Sequence[int]] | None = None,
           into: Sequence[bytearray | memoryview] | None = None) -> list[ParityFragment]:
    """The parity fragments of ``k`` data slices (each whole or as chunks). ``hashes`` are the
    slices' chunk hashes when already known (the store has them); else they are taken here.
    ``into``: as for :class:`Encoder`."""
    if hashes is None:
        hashes = [chunk_hashes(col, chunk_size) for col in slices]
    enc = Encoder(codec, [_column_length(col) for col in slices], hashes, chunk_size, into)
    for j, col in enumerate(slices):
        s = 0
        while (piece := _chunk(col, s, chunk_size)) is not None and len(piece):
            enc.add(j, s, piece)
            s += 1
    return enc.fragments()


def stripe_info(fragments: Iterable[ParityFragment]) -> StripeInfo:
    """The info the given parity fragments agree on (refused when they disagree)."""
    infos = {f.info.key(): f.info for f in fragments}
    if not infos:
        raise RestoreError("no parity fragment of the stripe: nothing records its layout")
    if len(infos) > 1:
        raise IntegrityError(f"the stripe's parity fragments disagree on its layout and "
                             f"hashes ({len(infos)} versions): not decoded")
    return next(iter(infos.values()))


def rebuild(codec: Codec, info: StripeInfo, have: Mapping[int, Column], want: Iterable[int],
            into: Mapping[int, bytearray | memoryview] | None = None) -> dict[int, memoryview]:
    """The columns at positions ``want`` (data ``0..k-1``, parity ``k..k+m-1``), rebuilt from
    ``have`` (position -> column; give parity fragments as ``ParityFragment.data``), written
    into ``into[p]`` where given (at least ``info.length(p)`` writable bytes), else into new
    buffers; returned as views of exactly ``info.length(p)`` bytes.

    Every piece used is checked against ``info``'s hash first; a piece that fails, or has the
    wrong length, is not used. Every rebuilt piece is checked against its hash (and its zero
    padding) before it is returned. Raises :class:`IntegrityError` when a chunk cannot be
    rebuilt from verified pieces because some were corrupt, :class:`RestoreError` when too few
    pieces exist at all; what was written into ``into`` by then is not to be used."""
    if (codec.k, codec.m, codec.backend, codec.unit) != (info.k, info.m, info.backend, info.unit):
        raise IntegrityError(f"stripe coded as ec:{info.k}+{info.m} with {info.backend} in units "
                             f"of {info.unit}, decoder is ec:{codec.k}+{codec.m} with "
                             f"{codec.backend} in units of {codec.unit}: not decoded")
    targets = sorted(set(want))
    total = info.k + info.m
    if any(not 0 <= p < total for p in [*targets, *have]):
        raise ValueError(f"positions outside 0..{total - 1}: want {targets}, have {sorted(have)}")
    if set(targets) & set(have):
        raise ValueError(f"positions {sorted(set(targets) & set(have))} are both given and wanted")
    c = info.chunk_size
    out: dict[int, memoryview] = {}
    for p in targets:
        buf = (into or {}).get(p)
        if buf is None:
            buf = bytearray(info.length(p))
        view = memoryview(buf).cast("B")
        if view.readonly or view.nbytes < info.length(p):
            raise ValueError(f"position {p} is rebuilt into {view.nbytes} bytes"
                             f"{' (read-only)' if view.readonly else ''}, needs "
                             f"{info.length(p)} writable")
        out[p] = view[:info.length(p)]
    scratch = {p: bytearray(c) for p in targets if p < info.k}  # a data slice's partial chunk
    for s in range(info.chunks):
        width = info.width(s)
        needed = [p for p in targets if info.piece_length(p, s)]
        if not needed:
            continue  # every wanted piece is past its column's end here
        usable: dict[int, Buffer] = {}
        refused: list[str] = []
        for p in range(total):
            if len(usable) == info.k:
                break
            n = info.piece_length(p, s)
            if n == 0 and p < info.k:
                usable[p] = b""  # a data slice that ended: zeros, known without any node
                continue
            if p in targets:
                continue
            col = have.get(p)
            if col is None:
                continue
            piece = _chunk(col, s, c)
            if piece is None or len(piece) != n:
                refused.append(f"position {p}: {0 if piece is None else len(piece)} bytes, "
                               f"expected {n}")
                continue
            got = xxhash.xxh3_64_intdigest(piece)
            if got != info.hashes[p][s]:
                refused.append(f"position {p}: xxh3 {got:#018x} != recorded "
                               f"{info.hashes[p][s]:#018x}")
                continue
            usable[p] = piece
        if len(usable) < info.k:
            absent = [p for p in range(total) if p not in usable and p not in have]
            why = (f"chunk {s} of the stripe: {len(usable)} verified pieces of the {info.k} "
                   f"needed (absent: positions {absent}"
                   + (f"; refused: {'; '.join(refused)}" if refused else "") + "); not decoded")
            if refused:
                raise IntegrityError(why)
            raise RestoreError(why)
        # full pieces straight into place; a data slice's partial last chunk through a
        # scratch chunk, whose zero padding is checked too
        dest = {p: (out[p][s * c:s * c + width] if info.piece_length(p, s) == width
                    else memoryview(scratch[p])[:width]) for p in needed}
        codec.rebuild(usable, dest, width)
        for p in needed:
            n = info.piece_length(p, s)
            piece = dest[p]
            if n < width and piece[n:] != _zeros(width - n):
                raise IntegrityError(f"rebuilt position {p} chunk {s}: non-zero padding; "
                                     "not used")
            got = xxhash.xxh3_64_intdigest(piece[:n])
            if got != info.hashes[p][s]:
                raise IntegrityError(f"rebuilt position {p} chunk {s}: xxh3 {got:#018x} != "
                                     f"recorded {info.hashes[p][s]:#018x}; not used")
            if n < width:
                out[p][s * c:s * c + n] = piece[:n]
        if refused:
            log.warning("chunk %d of the stripe: %s; rebuilt from other, verified pieces", s,
                        "; ".join(refused))
    return out


# ---- a node's bytes as K slices --------------------------------------------------------------

def slice_chunks(data: Buffer, k: int, chunk_size: int = CHUNK_BYTES) -> list[list[memoryview]]:
    """A node's bytes as ``k`` slices, each the list of its chunks (views, no copy): slice
    ``j`` holds chunks ``j, j+k, j+2k, ...``."""
    view = memoryview(data).cast("B")
    n = chunk_count(len(view), chunk_size)
    return [[view[c * chunk_size:(c + 1) * chunk_size] for c in range(j, n, k)]
            for j in range(k)]


def slice_lengths(nbytes: int, k: int, chunk_size: int = CHUNK_BYTES) -> list[int]:
    n = chunk_count(nbytes, chunk_size)
    return [sum(_piece_length(nbytes, c, chunk_size) for c in range(j, n, k)) for j in range(k)]


def slice_hashes(hashes: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """The node's chunk hash table cut like its bytes."""
    return [tuple(hashes[j::k]) for j in range(k)]


def join_slices(slices: Sequence[Buffer], k: int, chunk_size: int = CHUNK_BYTES) -> bytes:
    """A node's bytes from its ``k`` slices (the inverse of :func:`slice_chunks`)."""
    views = [memoryview(s).cast("B") for s in slices]
    if len(views) != k:
        raise ValueError(f"{len(views)} slices for k={k}")
    out = bytearray(sum(len(v) for v in views))
    for c in range(chunk_count(len(out), chunk_size)):
        j, i = c % k, c // k
        out[c * chunk_size:c * chunk_size + chunk_size] = views[j][i * chunk_size:
                                                                   (i + 1) * chunk_size]
    return bytes(out)


# ---- a group of nodes under an erasure placement --------------------------------------------

def encode_nodes(codec: Codec, placement: ErasurePlacement, data: Mapping[str, Buffer],
                 chunk_size: int = CHUNK_BYTES,
                 hashes: Mapping[str, Sequence[int]] | None = None,
                 ) -> dict[str, dict[tuple[int, int], ParityFragment]]:
    """Every stripe's parity, by holder: node -> {(stripe index, parity index): fragment}.
    ``data`` has every node's bytes; ``hashes`` their chunk hashes where known."""
    k = placement.k
    out: dict[str, dict[tuple[int, int], ParityFragment]] = {x: {} for x in placement.nodes}
    for i, stripe in enumerate(placement.stripes):
        cols: list[Column] = []
        tables: list[Sequence[int]] = []
        for j, node in enumerate(stripe.data):
            cols.append(slice_chunks(data[node], k, chunk_size)[j])
            table = hashes[node] if hashes and node in hashes else chunk_hashes(data[node],
                                                                                chunk_size)
            tables.append(slice_hashes(table, k)[j])
        for t, frag in enumerate(encode(codec, cols, chunk_size, tables)):
            out[stripe.parity[t]][(i, t)] = frag
    return out


def rebuild_nodes(codec: Codec, placement: ErasurePlacement, lost: Iterable[str],
                  data: Mapping[str, Buffer],
                  parity: Mapping[str, Mapping[tuple[int, int], ParityFragment]],
                  ) -> dict[str, bytes]:
    """The bytes of the ``lost`` nodes, rebuilt from the survivors: ``data`` (node -> its
    bytes) and ``parity`` (holder -> the fragments it holds, as from :func:`encode_nodes`).
    Each lost slice is decoded in its own stripe and checked against the hashes its parity
    fragments recorded."""
    gone = set(lost)
    unknown = gone - set(placement.nodes)
    if unknown:
        raise RestoreError(f"nodes {sorted(unknown)} are not in this erasure placement")
    k = placement.k
    slices: dict[str, list[bytes]] = {x: [b""] * k for x in gone}
    chunk_size = CHUNK_BYTES
    for i, stripe in enumerate(placement.stripes):
        wanted = [j for j, node in enumerate(stripe.data) if node in gone]
        if not wanted:
            continue
        frags = [parity[holder][(i, t)] for t, holder in enumerate(stripe.parity)
                 if holder not in gone and (i, t) in parity.get(holder, {})]
        info = stripe_info(frags)
        chunk_size = info.chunk_size
        have: dict[int, Column] = {f.position: f.data for f in frags}
        for j, node in enumerate(stripe.data):
            if node not in gone:
                have[j] = slice_chunks(data[node], k, chunk_size)[j]
        for j, col in rebuild(codec, info, have, wanted).items():
            slices[stripe.data[j]][j] = col
    # every node's K slices sit in K stripes of its group, so each lost one was rebuilt above
    return {node: join_slices(parts, k, chunk_size) for node, parts in slices.items()}
