"""Test helper: fill a snapshot segment exactly as a rank and its store do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import xxhash

from ftrun.snapshot import persist, verify
from ftrun.snapshot.manifest import flatten, manifest_blob, parse_manifest, tensor_view
from ftrun.snapshot.segment import STAGED, VERIFIED, WRITING, Segment, segment_name


def stage_segment(run_id: str, rank: int, buffer: int, state: Any, *, step: int,
                  world_size: int = 1, final_state: int = VERIFIED,
                  owner_pid: int | None = None) -> Segment:
    """Data, then manifest (STAGED), then hashes (VERIFIED); stop at ``final_state``."""
    flat = flatten(state)
    blob = manifest_blob(flat, step=step, rank=rank, world_size=world_size, meta={"t": 1})
    seg = Segment.create(segment_name(run_id, rank, buffer), manifest_cap=len(blob) * 2 + 4096,
                         n_tensors=len(flat.tensors), data_len=flat.data_len,
                         owner_pid=owner_pid or os.getpid())
    try:
        with seg.data() as data:
            for entry, src in zip(flat.tensors, flat.sources, strict=True):
                if entry.nbytes:
                    tensor_view(data, entry).copy_(src)
            hashes = verify.hash_chunks(data, seg.header().chunk_size)
        if final_state == WRITING:
            seg.set_state(WRITING, step=step)
            return seg
        xh = seg.write_manifest(blob)
        seg.set_state(STAGED, step=step, manifest_len=len(blob), manifest_xxh3=xh)
        if final_state == VERIFIED:
            seg.set_state(VERIFIED, hashes_xxh3=seg.write_hashes(hashes))
    except BaseException:
        seg.unlink()  # never leak a segment, even when the helper fails
        raise
    return seg


def write_plain(root: Path, state: Any, *, step: int, rank: int = 0, world_size: int = 1,
                meta: dict[str, Any] | None = None,
                layout: dict[str, dict[str, Any]] | None = None) -> Path:
    """persist.write_rank from an in-memory buffer (no segment), for tests needing many steps.

    ``layout`` sets manifest fields by tensor key (``{"/model/w": {"global_shape": [8, 3],
    "offsets": [4, 0], "placements": ["S(0)"]}}``): a shard as a DTensor would record it.
    """
    flat = flatten(state)
    doc = parse_manifest(manifest_blob(flat, step=step, rank=rank, world_size=world_size,
                                       meta=meta or {}))
    for entry in doc["tensors"]:
        entry.update((layout or {}).get(entry["key"], {}))
    buf = bytearray(flat.data_len)
    data = memoryview(buf)
    for entry, src in zip(flat.tensors, flat.sources, strict=True):
        if entry.nbytes:
            tensor_view(data, entry).copy_(src)
    hashes = [xxhash.xxh3_64_intdigest(data[e.offset:e.offset + e.nbytes]) for e in flat.tensors]
    return persist.write_rank(root, doc, bytes(buf), hashes)
