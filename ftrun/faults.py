"""Fault injection that ships with ftrun, for tests and drills.

``corrupt_newest_snapshot`` flips one byte in the data of a rank's newest verified snapshot,
exactly as a bad DIMM or a stray write would. ftrun must then refuse to load it and fall
back to an older committed step; tests assert both. ``corrupt_persisted`` does the same to a
step persisted on disk (bit rot, a torn copy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ftrun import knobs
from ftrun.errors import FtrunError, FtrunTimeoutError
from ftrun.snapshot import segment as shm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corruption:
    segment: str
    step: int
    offset: int  # within the data region


def corrupt_newest_snapshot(rank: int, run_id: str | None = None,
                            timeout_s: float = 30.0) -> Corruption:
    """Flip a byte in ``rank``'s newest VERIFIED snapshot (waiting for one to be verified)."""
    run_id = run_id or knobs.RUN_ID.get()
    if not run_id:
        raise FtrunError("no run id: corrupt_newest_snapshot needs FTRUN_RUN_ID or run_id=")
    deadline = time.monotonic() + timeout_s
    while True:
        newest: tuple[int, int, shm.Segment] | None = None  # (step, state, segment)
        for buffer in (0, 1):
            try:
                seg = shm.Segment.open(shm.segment_name(run_id, rank, buffer))
            except FileNotFoundError:
                continue
            h = seg.header()
            if h.state != shm.EMPTY and (newest is None or h.step > newest[0]):
                newest = (h.step, h.state, seg)
        # Wait until the newest snapshot is verified, so the one corrupted is the one a
        # restore would pick.
        if newest is not None and newest[1] == shm.VERIFIED:
            step, _, seg = newest
            h = seg.header()
            offset = h.data_len // 2
            seg.mm[h.data_off + offset] ^= 0xFF
            log.warning("fault injection: flipped byte %d of rank %d's snapshot of step %d (%s)",
                        offset, rank, step, seg.name)
            return Corruption(seg.name, step, offset)
        if time.monotonic() > deadline:
            raise FtrunTimeoutError(f"rank {rank} has no verified snapshot to corrupt after "
                                    f"{timeout_s:g} s")
        time.sleep(0.05)


@dataclass(frozen=True)
class FileCorruption:
    file: str
    key: str  # the tensor whose stored bytes were hit
    offset: int  # within the file


def corrupt_persisted(persist_dir: str, step: int, rank: int) -> FileCorruption:
    """Flip one byte of the largest tensor's data in persisted ``step_<S>/rank_<r>``."""
    import torch

    from ftrun.snapshot import persist

    path = persist.rank_dir(persist_dir, step, rank)
    spans = persist.storage_spans(path)
    tensors = persist.read_tensors(path)
    for key, t in sorted(tensors.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if not raw or key not in spans:
            continue
        name, start, length = spans[key]
        file = path / name
        with open(file, "r+b") as f:
            f.seek(start)
            stored = f.read(length)
            at = stored.find(raw)  # the tensor's bytes inside its stored record
            if at < 0:
                continue
            offset = start + at + len(raw) // 2
            f.seek(offset)
            f.write(bytes([stored[at + len(raw) // 2] ^ 0xFF]))
        log.warning("fault injection: flipped byte %d of %s (tensor %s)", offset, file, key)
        return FileCorruption(str(file), key, offset)
    raise FtrunError(f"{path} stores no tensor whose bytes could be located to corrupt")
