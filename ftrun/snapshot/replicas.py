"""Replicated state in a snapshot: where it lies, and its digest from the chunk hashes.

Data-parallel replicas (DDP ranks) hold bit-identical parameters and optimizer state after
every optimizer step. A rank that knows which of its tensors are such replicas (ftrun.rank.
replicas) lays them out first in its data region, in one *block* per replica group that
starts on a hash-chunk boundary; the tensors that differ between ranks (RNG states, buffers,
the data position) come after. Every whole chunk of a block then holds replicated bytes
only, at the same place on every replica, so the chunk hashes the rank takes anyway
(ftrun.snapshot.verify) are equal across replicas exactly when those bytes are. The block's
last, partial chunk also holds per-rank bytes: the rank hashes the block's part of it alone
(:func:`seal`, at most one chunk's worth, on its copy thread). The store derives the block's
digest from those hashes (:func:`block_digests`) without reading a byte of data, and the
coordinator compares the digests across the group (ftrun.coordinator.corruption).

The manifest's ``meta["replicas"]`` lists the blocks: ``{"group", "lead", "lo", "hi",
"chunk", "tail"}`` — the replica group's name (equal on every member), whether this rank is
the group's lowest rank (its store sends the tensor names), the block's byte range
``[lo, hi)``, the chunk size it was laid out for, and the xxh3 of the block's bytes in its
last partial chunk (hex; "" when the block ends on a chunk boundary).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from ftrun.snapshot.manifest import Flattened, TensorEntry, entries
from ftrun.snapshot.segment import align

# Parts per block in a report: a diverging part names the tensors in it. Bounded so that a
# report stays small at any model size (a part of a 1 GiB block is 32 MiB).
MAX_PARTS = 32


@dataclass(frozen=True)
class Group:
    """Tensors that are equal on every rank of one replica group."""

    name: str  # the same on every member, different for every group
    lead: bool  # this rank is the group's lowest rank
    indices: tuple[int, ...]  # into Flattened.tensors


def place(flat: Flattened, groups: list[Group], chunk_size: int) -> tuple[
        Flattened, list[dict[str, Any]], list[tuple[int, int]]]:
    """``flat`` with each group's tensors first, one block per group starting on a chunk
    boundary; returns the new layout, the manifest's ``replicas`` meta (its ``tail`` a
    placeholder of the final length, for :func:`seal`), and the alignment gaps between the
    tensors of a block (the writer zeroes them: they are hashed with the block)."""
    groups = [g for g in groups if g.indices]
    if not groups:
        return flat, [], []
    tensors = list(flat.tensors)
    offset = 0
    meta: list[dict[str, Any]] = []
    gaps: list[tuple[int, int]] = []
    placed: set[int] = set()
    for g in groups:
        lo = offset = -(-offset // chunk_size) * chunk_size
        for i in g.indices:
            if i in placed:
                continue
            placed.add(i)
            if align(offset) > offset:
                gaps.append((offset, align(offset)))
            offset = align(offset)
            tensors[i] = replace(tensors[i], offset=offset)
            offset += tensors[i].nbytes
        meta.append({"group": g.name, "lead": g.lead, "lo": lo, "hi": offset,
                     "chunk": chunk_size, "tail": "0" * 16})
    offset = align(offset)
    for i, e in enumerate(tensors):
        if i not in placed:
            tensors[i] = replace(e, offset=offset)
            offset = align(offset + e.nbytes)
    return Flattened(flat.tree, tensors, flat.sources, offset), meta, gaps


def seal(blocks: list[dict[str, Any]], data: memoryview) -> None:
    """Fill in each block's ``tail``: the xxh3 of its bytes in its last, partial chunk (the
    chunk's hash covers the per-rank bytes after it too). Call once the block is copied."""
    for b in blocks:
        lo, hi, chunk = b["lo"], b["hi"], b["chunk"]
        start = max(lo, hi // chunk * chunk)
        b["tail"] = f"{xxhash.xxh3_64_intdigest(data[start:hi]):016x}" if hi > start else ""


def _fold(hashes: list[int]) -> str:
    return f"{xxhash.xxh3_64_intdigest(struct.pack(f'<{len(hashes)}Q', *hashes)):016x}"


def block_digests(doc: dict[str, Any], hashes: list[int], chunk_size: int) -> list[dict[str, Any]]:
    """The digest of each replicated block of a verified shard, from its chunk hashes and its
    tail hash: per block ``{"group", "digest", "parts"}`` (folded whole and in up to
    MAX_PARTS runs of chunks), with ``"names"`` on the group's lead: per part, the first and
    last tensor in it and how many there are. A block laid out for another chunk size than
    the segment's is left out (its whole chunks are not the segment's)."""
    blocks = (doc.get("meta") or {}).get("replicas") or []
    if not blocks:
        return []
    table: list[TensorEntry] = entries(doc)
    out = []
    for b in blocks:
        lo, hi = int(b["lo"]), int(b["hi"])
        if int(b.get("chunk", 0)) != chunk_size:
            continue
        c0 = lo // chunk_size
        chunks = hashes[c0:hi // chunk_size] + ([int(b["tail"], 16)] if b.get("tail") else [])
        n = len(chunks)
        cuts = [n * p // MAX_PARTS for p in range(MAX_PARTS + 1)] if n > MAX_PARTS \
            else list(range(n + 1))
        runs = [(a, z) for a, z in zip(cuts, cuts[1:], strict=False) if z > a]
        entry: dict[str, Any] = {"group": str(b["group"]), "digest": _fold(chunks),
                                 "parts": [_fold(chunks[a:z]) for a, z in runs]}
        if b.get("lead"):
            names = []
            for a, z in runs:
                plo, phi = (c0 + a) * chunk_size, (c0 + z) * chunk_size
                keys = [e.key for e in table if e.nbytes and lo <= e.offset < hi
                        and e.offset < phi and e.offset + e.nbytes > plo]
                names.append([keys[0], keys[-1], len(keys)] if keys else ["", "", 0])
            entry["names"] = names
        out.append(entry)
    return out
