"""Fault injection that ships with ftrun, for tests and drills.

``corrupt_newest_snapshot`` has the node's store flip one byte in the data of a rank's newest
verified snapshot, exactly as a bad DIMM or a stray write would. ftrun must then refuse to load it and fall
back to an older committed step; tests assert both. ``corrupt_persisted`` does the same to a
step persisted on disk (bit rot, a torn copy). ``corrupt_replica`` flips a byte of the newest
verified replica this host holds of another node's rank: once that node is lost, the replica
is the only copy of its step, and a restore must refuse it. ``corrupt_fragment`` does the same
to a parity fragment this host's store built (``--redundancy ec:K+M``): a lost node's shards
that need it cannot be rebuilt, and the restore must take another step or the disk.
``kill_once`` SIGKILLs the calling rank, once per job, as a crashed host or an OOM kill would;
``kill_in_snapshot_copy`` does it from the rank's copy thread while a snapshot is half
written.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftrun import knobs
from ftrun.errors import FtrunError, FtrunTimeoutError
from ftrun.snapshot.api import SegmentState

if TYPE_CHECKING:
    from ftrun.snapshot.segment import Segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corruption:
    segment: str
    step: int
    offset: int  # within the data region


def corrupt_newest_snapshot(rank: int, run_id: str | None = None,
                            timeout_s: float = 30.0) -> Corruption:
    """Have the node's store flip a byte in ``rank``'s newest snapshot, once it is verified.

    Goes through the store's API (the store owns the segments): called inside a rank of an
    ftrun job, where FTRUN_STORE and the job secret are set.
    """
    from ftrun.protocol.transport import Client

    run_id = run_id or knobs.RUN_ID.get()
    url = knobs.STORE.get()
    if not (run_id and url):
        raise FtrunError("corrupt_newest_snapshot runs inside a rank of an ftrun job "
                         f"({knobs.RUN_ID.name} and {knobs.STORE.name} unset)")
    chan = Client(url, knobs.SECRET.get().encode(), run_id, f"fault:{rank}",
                  peer="snapshot store")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            reply = chan.request("catalog_request", {"rank": rank}, "catalog_reply", 5.0,
                                 attempts=3)
            held = [r for r in reply.body["records"] if r["state"] != SegmentState.EMPTY]
            # Wait until the newest snapshot is verified, so the one corrupted is the one a
            # restore would pick.
            if held and max(held, key=lambda r: r["step"])["state"] == SegmentState.VERIFIED:
                done = chan.request("fault_corrupt", {"rank": rank}, "fault_reply", 5.0)
                log.warning("fault injection: the store flipped byte %d of rank %d's snapshot "
                            "of step %d (%s)", done.body["offset"], rank, done.body["step"],
                            done.body["segment"])
                return Corruption(done.body["segment"], done.body["step"], done.body["offset"])
            if time.monotonic() > deadline:
                raise FtrunTimeoutError(f"rank {rank} has no verified snapshot to corrupt "
                                        f"after {timeout_s:g} s")
            time.sleep(0.05)
    finally:
        chan.close()


def _flip_middle_byte(seg: Segment) -> int:
    """Flip the byte in the middle of ``seg``'s data region (its state and hashes as they
    are), then close it; returns the byte's offset within the data."""
    try:
        h = seg.header()
        offset = h.data_len // 2
        seg.mm[h.data_off + offset] ^= 0xFF
    finally:
        seg.close()
    return offset


def corrupt_replica(run_id: str, origin: str, rank: int | None = None) -> Corruption:
    """Flip one byte in the data of the newest verified replica this host holds of ``origin``'s
    shards (of ``rank`` if given), leaving its state and hashes as they are.

    Runs on the holding host (FTRUN_SHM_DIR as its store's). Meant for after the origin is
    lost: a live origin's sender would soon replace the replica with a newer step.
    """
    from ftrun.store.catalog import Catalog, newest_replica

    newest = newest_replica(run_id, origin, rank)
    if newest is None:
        raise FtrunError(f"this host ({Catalog.shm_dir()}) holds no verified replica of {origin}'s "
                         f"shards{'' if rank is None else f' of rank {rank}'} in job {run_id}")
    step, seg = newest
    offset = _flip_middle_byte(seg)
    log.warning("fault injection: flipped byte %d of the replica of %s's shard of step %d (%s)",
                offset, origin, step, seg.name)
    return Corruption(seg.name, step, offset)


def corrupt_fragment(run_id: str, step: int | None = None) -> Corruption:
    """Flip one byte in the data of a verified parity fragment this host's store holds (of
    ``step``, else of the newest step it holds fragments of), leaving its state and hashes as
    they are. Runs on the holding host (FTRUN_SHM_DIR as its store's)."""
    from ftrun.errors import IntegrityError
    from ftrun.snapshot import segment as shm
    from ftrun.store.ec_store import FragmentKey, ec_prefix

    found: list[tuple[int, str]] = []
    for path in shm.list_segments(ec_prefix(run_id)):
        if FragmentKey.of(path.name) is None:
            continue  # a rebuilt shard, not a fragment
        try:
            seg = shm.Segment.open(path)
        except (OSError, ValueError, IntegrityError):
            continue
        try:
            h = seg.header()
            if h.state == shm.VERIFIED and h.data_len > 0 and (
                    step is None or h.step == step):
                found.append((h.step, path.name))
        finally:
            seg.close()
    if not found:
        raise FtrunError(f"this host ({shm.SHM_DIR}) holds no verified parity fragment of job "
                         f"{run_id}{'' if step is None else f' for step {step}'}")
    at, name = max(found)
    offset = _flip_middle_byte(shm.Segment.open(shm.SHM_DIR / name))
    log.warning("fault injection: flipped byte %d of parity fragment %s (step %d)", offset, name,
                at)
    return Corruption(name, at, offset)


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


def fire_once(marker: str) -> bool:
    """True for the first caller in the job, which creates the file ``marker`` (O_EXCL) and
    writes the time into it (benchmarks time a fault from it; tests assert that it exists,
    i.e. that the fault fired); False for every later one."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{time.time():.6f}\n".encode())
    finally:
        os.close(fd)
    return True


def kill_once(name: str, rank: int, step: int, directory: str | None = None) -> None:
    """SIGKILL this process, the first time any process of the job calls this for ``rank``
    and ``step``; later calls (the restarted rank passing the same step again) return.

    Once per job through a marker file ``<name>-fault-rank<rank>-step<step>`` that the first
    caller creates (O_EXCL) in ``directory`` (default: the job's directory, FTRUN_JOB_DIR);
    tests assert that it exists, i.e. that the fault fired. Logs a warning first.
    """
    directory = directory or knobs.JOB_DIR.get()
    if not directory:
        raise FtrunError(f"kill_once needs a directory for its marker file ({knobs.JOB_DIR.name} "
                         "is unset outside an ftrun job): pass directory=")
    if not fire_once(os.path.join(directory, f"{name}-fault-rank{rank}-step{step}")):
        return  # fired already in this job
    log.warning("fault injection: SIGKILL rank %d in step %d (%s)", rank, step, name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_snapshot_copy(rank: int, step: int, directory: str | None = None) -> None:
    """Arm a SIGKILL of this process from its snapshot copy thread, in the middle of copying
    the snapshot of ``step`` (its first group of tensors copied, the rest, the hashes and the
    manifest not): the rank dies with that snapshot half written, as a crash during a copy
    would leave it. Once per job, like :func:`kill_once` (same marker file)."""
    from ftrun.rank import save

    directory = directory or knobs.JOB_DIR.get()
    if not directory:
        raise FtrunError(f"kill_in_snapshot_copy needs a directory for its marker file "
                         f"({knobs.JOB_DIR.name} is unset outside an ftrun job): pass directory=")

    def fault(copying: int) -> None:
        if copying == step:
            kill_once("copy", rank, step, directory)

    save.copy_fault = fault
