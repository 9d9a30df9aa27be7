"""The store's persist writer: copies a persist target's shards out of shared memory and
writes them to disk, off the message loop.

A target's buffers are pinned (their ranks' claims refused) until the writer thread has
copied them out; what was copied is checked against the rank's chunk hashes before anything
reaches the disk (ftrun.snapshot.verify). The writer also keeps what became of each target of
the epoch, which the store reports to the coordinator.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ftrun.coordinator.commits import MAX_TARGETS
from ftrun.errors import IntegrityError
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.api import PersistConfig
from ftrun.snapshot.manifest import parse_manifest
from ftrun.store.catalog import Catalog, rank_of

log = logging.getLogger("ftrun.store")

WRITE_TIMEOUT_S = 600.0

# A shard copied out of shared memory for the disk: manifest, data region, chunk size, and
# the chunk hashes the rank took as it wrote it.
Shard = tuple[dict[str, Any], bytes, int, list[int]]


class PersistWriter:
    """Writes persist targets of this node's shards, one at a time, on a thread of its own."""

    def __init__(self, persist: PersistConfig, catalog: Catalog,
                 hashers: ThreadPoolExecutor) -> None:
        self.cfg = persist
        self.catalog = catalog
        self._hashers = hashers
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-persist")
        self._pin_lock = threading.Lock()
        self.pinned: set[str] = set()  # segments of a persist target not copied out yet
        self.pending_write: Future[None] | None = None
        self._writing_step: int | None = None
        self.persisted_step: int | None = None
        self.handled: dict[int, str] = {}  # persist target -> what became of it (this epoch)
        self.final: int | None = None  # the epoch's final target, once known
        self.report_due = False  # tell the coordinator about targets done, at once
        self._restarted = True  # until the first reply: older targets were handled before

    def new_epoch(self, restarted: bool) -> None:
        """Forget the targets of the epoch before."""
        self.handled.clear()
        self.final = None
        self._restarted = restarted
        self.report_due = True

    def take_targets(self, targets: list[int], base: int) -> None:
        """Handle the persist targets a commit_info reply listed (oldest first)."""
        if self._restarted:
            # A store restarted mid-epoch: the older targets were written (or given up) by
            # the store before it, and their buffers are gone by now.
            self._restarted = False
            for step in targets[:-1]:
                self.handled.setdefault(step, "before this store started")
        for step in targets:
            if self.due(step):
                self.persist_target(step, base)

    def persist_target(self, step: int, base: int) -> None:
        """Copy this node's shards of target ``step`` out of shared memory and write them to
        disk, in the background (off the message loop). Until its copy is taken, no rank may
        overwrite a shard of the target: its claims are refused (the rank skips a snapshot
        rather than wait). ``base`` is the step the epoch resumed from.

        If the previous write is still running, the disk is behind: this target is skipped
        here (logged), never waited for, except the final one (the job is ending, the
        buffers no longer change).
        """
        if not self.cfg.dir:
            return
        final = step == self.final
        self.report_due = True
        while len(self.handled) >= 4 * MAX_TARGETS:
            del self.handled[min(self.handled)]
        if step <= 0:
            self.handled[step] = "nothing to write"
            return
        busy = self.pending_write is not None and not self.pending_write.done()
        if busy and not final:
            self.handled[step] = "skipped: disk behind"
            log.warning("not persisting step %d here: the write of step %s is still running "
                        "(the disk is behind; step %d will be partial on disk and pruned)",
                        step, self._writing_step, step)
            return
        if busy:
            self.wait()
        names, missing = self.locate_step(step)
        if missing and step == base and not names:
            # The epoch began there, restored from disk (or written before a restart).
            self.handled[step] = "the epoch's base step"
            log.info("persist target %d is the step this epoch resumed from; nothing newer "
                     "to write here", step)
            return
        if missing:
            self.handled[step] = f"not held: {missing}"
            log.error("cannot persist step %d: %s; it stays partial on disk", step, missing)
            return
        self.handled[step] = "written"
        log.info("persisting step %d%s: %d shard(s)", step, " (final)" if final else "",
                 len(names))
        with self._pin_lock:
            self.pinned.update(names)
        self._writing_step = step
        self.pending_write = self.writer.submit(self._copy_and_write, step, names)

    def due(self, step: int) -> bool:
        """Whether target ``step`` still needs handling here: never handled, or skipped
        while the disk was behind and now the final target (which is waited for)."""
        outcome = self.handled.get(step)
        return outcome is None or (step == self.final and outcome.startswith("skipped"))

    def wait(self) -> None:
        """Wait for the write in progress, if any (bounded by WRITE_TIMEOUT_S)."""
        if self.pending_write is not None:
            self.pending_write.result(timeout=WRITE_TIMEOUT_S)

    def locate_step(self, step: int) -> tuple[list[str], str]:
        """The segments holding every local rank's verified shard of ``step`` (rank order),
        or why some rank has none."""
        held: dict[int, str] = {}
        ranks: set[int] = set()
        for name in self.catalog.names():
            rank, _ = rank_of(name)
            ranks.add(rank)
            seg = self.catalog.open(name)
            if seg is None or rank in held:
                continue
            h = seg.header()
            if h.state == shm.VERIFIED and h.step == step:
                held[rank] = name
        problems = []
        lacking = sorted(ranks - set(held))
        if lacking:
            problems.append(f"rank(s) {', '.join(map(str, lacking))} no longer hold it")
        if not ranks:
            problems.append("no snapshot buffers on this node")
        return [held[r] for r in sorted(held)], "; ".join(problems)

    def pinned_buffer(self, name: str) -> bool:
        with self._pin_lock:
            return name in self.pinned

    def copy_shards(self, step: int, names: list[str]) -> tuple[list[Shard], str]:
        """Copies of the shards of ``step`` in segments ``names`` (each unpinned once copied),
        or why one could not be copied. Runs on the writer thread, with its own mappings."""
        shards: list[Shard] = []
        problems = []
        for name in names:
            try:
                seg = self.catalog.open_private(name)
            except (OSError, IntegrityError, ValueError) as e:
                problems.append(f"{name}: {e}")
                continue
            try:
                h = seg.header()
                if h.state != shm.VERIFIED or h.step != step:
                    problems.append(f"{name} holds step {h.step} ({h.state_name}) now")
                    continue
                doc = parse_manifest(seg.manifest_bytes(h))
                shard = (doc, bytes(seg.data(h)), h.chunk_size, seg.hashes(h))
                after = seg.header()
                if after.state != shm.VERIFIED or after.step != step:
                    problems.append(f"{name}: changed while being copied")
                    continue
                shards.append(shard)
            except IntegrityError as e:
                problems.append(f"{name}: {e}")
            finally:
                seg.close()
                with self._pin_lock:
                    self.pinned.discard(name)
        return shards, "; ".join(problems)

    def _copy_and_write(self, step: int, names: list[str]) -> None:
        try:
            shards, problem = self.copy_shards(step, names)
        finally:
            with self._pin_lock:
                self.pinned.difference_update(names)
        if problem:
            self.handled[step] = f"not held: {problem}"
            self.report_due = True
            log.error("cannot persist step %d: %s; it stays partial on disk", step, problem)
            return
        self.write(step, shards)

    def write(self, step: int, shards: list[Shard]) -> None:
        from ftrun.snapshot import persist

        assert self.cfg.dir
        root = Path(self.cfg.dir)
        t0 = time.perf_counter()
        try:
            for doc, data, chunk_size, chunk_hashes in shards:
                # What was copied out of shared memory is checked against the rank's own
                # hashes before anything is written: bytes changed after the rank wrote them
                # never reach the disk.
                verify.check_copy(data, doc, chunk_size, chunk_hashes,
                                  f"step {step} rank {doc['rank']}", self._hashers)
                persist.write_rank(root, doc, memoryview(data), verify.tensor_hashes(doc, data))
            if any(doc["rank"] == 0 for doc, *_ in shards):
                persist.prune(root, self.cfg.keep)
        except Exception:
            log.exception("persisting step %d failed", step)
            return
        finally:
            self.report_due = True
        self.persisted_step = step
        log.info("persisted step %d to %s in %.2f s", step, root, time.perf_counter() - t0)

    def writing(self) -> int | None:
        """The target being written now (None: the writer is idle)."""
        job = self.pending_write
        return self._writing_step if job is not None and not job.done() else None
