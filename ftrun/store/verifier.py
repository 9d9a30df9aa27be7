"""The store's verifier: checks what a rank staged and marks it VERIFIED.

The rank hashed every chunk as it wrote it; the verifier checks that hash table (or takes the
hashes itself when the rank staged without them), marks the buffer VERIFIED and reports the
shard to the commit mirror, which tells the coordinator. A shard that fails is reported as
not verified, so that its step counts as dead.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ftrun.errors import IntegrityError
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import parse_manifest
from ftrun.snapshot.replicas import block_digests
from ftrun.store.catalog import Catalog, rank_of
from ftrun.store.commits import CommitMirror

log = logging.getLogger("ftrun.store")


class Verifier:
    """Verifies staged segments of this node's ranks, on the store's hashing threads."""

    def __init__(self, node_id: str, catalog: Catalog, hashers: ThreadPoolExecutor,
                 commits: CommitMirror) -> None:
        self._node_id = node_id
        self.catalog = catalog
        self._hashers = hashers
        self._commits = commits

    def verify_staged(self, name: str, expect_step: int | None = None) -> tuple[bool, str, int]:
        seg = self.catalog.open(name)
        if seg is None:
            return False, "segment missing", -1
        h = seg.header()
        if h.state == shm.VERIFIED and (expect_step is None or h.step == expect_step):
            return True, "", h.step
        if h.state != shm.STAGED:
            return False, f"segment is {h.state_name}, not staged", h.step
        if expect_step is not None and h.step != expect_step:
            return False, f"segment holds step {h.step}, not {expect_step}", h.step
        t0 = time.perf_counter()
        try:
            doc = parse_manifest(seg.manifest_bytes(h))
            if h.hashes_xxh3:
                # The rank hashed what it wrote, while it wrote it; the table is checked
                # against its own hash here, and the data against the table on every later
                # hop (restore, persist, inspect --verify).
                chunks = seg.hashes(h)
                hx = h.hashes_xxh3
            else:  # staged without its hashes: take them here
                chunks = verify.hash_chunks(seg.data(h), h.chunk_size, self._hashers)
                hx = seg.write_hashes(chunks)
            # The replicated tensors' digest, from the chunk hashes alone: the coordinator
            # compares it across replicas (ftrun.coordinator.corruption).
            digests = block_digests(doc, chunks, h.chunk_size)
        except IntegrityError as e:
            # That shard can never be part of a commit: say so, so that the step counts as
            # dead and no rank's buffer waits for it.
            if h.epoch:
                self._commits.ask_epoch("snap_verified", {
                    "node_id": self._node_id, "epoch": h.epoch, "rank": rank_of(name)[0],
                    "step": h.step, "nbytes": h.data_len, "ok": False}, h.epoch)
            return False, str(e), h.step
        # The rank may have begun overwriting meanwhile (it never does without a claim, but
        # check): only mark verified what is still the staged step.
        now = seg.header()
        if now.state != shm.STAGED or now.step != h.step:
            return False, "overwritten while hashing", h.step
        seg.set_state(shm.VERIFIED, hashes_xxh3=hx)
        log.debug("verified %s step %d (%d bytes) in %.1f ms", name, h.step, h.data_len,
                  (time.perf_counter() - t0) * 1e3)
        self._report(name, h, doc, digests)
        return True, "", h.step

    def report_again(self, name: str) -> bool:
        """Report a shard that a previous store of this node verified: it may have died
        between marking it VERIFIED and its report reaching the coordinator, and a step the
        coordinator never hears of from every rank never commits (every later claim of the
        job's ranks would then be refused). Reporting a shard twice changes nothing.
        Returns whether it was reported."""
        seg = self.catalog.open(name)
        if seg is None:
            return False
        h = seg.header()
        if h.state != shm.VERIFIED or not h.epoch:
            return False
        try:
            doc = parse_manifest(seg.manifest_bytes(h))
            digests = block_digests(doc, seg.hashes(h), h.chunk_size)
        except IntegrityError as e:
            log.warning("%s (step %d): not reported again: %s", name, h.step, e)
            return False
        self._report(name, h, doc, digests)
        return True

    def _report(self, name: str, h: shm.Header, doc: dict[str, Any],
                digests: list[dict[str, Any]]) -> None:
        """Tell the commit mirror (and through it the coordinator) the shard is verified."""
        if not self._commits.world_size:
            self._commits.world_size = int(doc["world_size"])
        self._commits.report_verified(h.epoch, rank_of(name)[0], h.step, h.data_len, digests)

    def verify_rank(self, rank: int) -> None:
        for buffer in (0, 1):
            self._verify_if_staged(self.catalog.buffer_name(rank, buffer))

    def verify_all(self) -> None:
        for name in self.catalog.names():
            self._verify_if_staged(name)

    def _verify_if_staged(self, name: str) -> None:
        seg = self.catalog.open(name)
        if seg is not None and seg.header().state == shm.STAGED:
            self.verify_staged(name)
