"""The node's snapshot store: a process beside the ranks that outlives their restarts.

It does the work the training loop must not wait for:

- **verify**: when a rank has staged a snapshot in its shared-memory buffer (with the xxh3-64
  of every 4 MiB chunk, taken as it copied), the store checks the hash table, marks the
  buffer VERIFIED and tells the coordinator, which commits step S once every rank's shard of
  S is verified. Every later reader re-hashes against that table (ftrun.snapshot.verify);
- **claims**: before a rank overwrites its older buffer it asks here; the answer is yes only
  once the step in its newer buffer is committed, so the newest committed snapshot is never
  overwritten; or, when that step is dead (some rank skipped it), to overwrite the newer
  buffer instead. A rank never waits for the answer: without it, the snapshot is skipped;
- **catalog**: a record of every shard held here (ftrun.store.catalog), served to ranks
  (restore), ``ftrun inspect`` and fault injection; nothing else opens segments by name;
- **persist**: committed steps go to disk every N steps or T seconds, on SIGUSR1, and at the
  end (job end, SIGTERM, preemption), off the training path and off the message loop. The
  coordinator picks the step (a *persist target*, ftrun.coordinator.commits) so that every
  node writes the same one; the store pins its ranks' shards of a target (their claims are
  refused) until the writer thread has copied them out, verified and written them;
- **replicas** (``--replicas m``): committed shards are streamed to peer stores and peers'
  shards received, chunk by chunk, each chunk verified (ftrun.store.replica);
- **adopt and clean**: segments are named after the job, so a restarted store picks them up
  (verifying whatever was staged but not yet checked); segments of dead jobs are removed;
  on SIGTERM, the job's own segments go too.

Run by the launcher as ``python -m ftrun.store.store`` (with a parent-death signal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ftrun import jobs, knobs, protocol
from ftrun.coordinator.client import HINT as COORDINATOR_HINT
from ftrun.coordinator.commits import FINAL_SETTLE_S, MAX_TARGETS, CommitTracker
from ftrun.errors import FtrunError, IntegrityError, ProtocolError, UnreachableError
from ftrun.pdeath import set_parent_death_signal
from ftrun.protocol.transport import Client, Server
from ftrun.sigrelay import SignalRelay
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.api import SegmentState
from ftrun.snapshot.manifest import parse_manifest
from ftrun.store.api import ClaimAnswer, StoreConfig
from ftrun.store.catalog import Catalog, rank_of

log = logging.getLogger("ftrun.store")

POLL_MS = 100
REPORT_EVERY_S = 2.0
POLL_TARGETS_S = 1.0
COORDINATOR_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 600.0
# How long ranks skip snapshots to keep the newest durable step while replication is behind.
DURABLE_KEEP_S = 60.0


# A shard copied out of shared memory for the disk: manifest, data region, chunk size, and
# the chunk hashes the rank took as it wrote it.
Shard = tuple[dict[str, Any], bytes, int, list[int]]


def default_threads() -> int:
    """Hashing threads the store may use: what a node of training ranks can spare."""
    return max(2, min(8, (os.cpu_count() or 2) // 8))


def _warm_up() -> None:
    from ftrun.snapshot import persist

    persist.import_dcp()


class SnapshotStore:
    def __init__(self, cfg: StoreConfig, secret: bytes) -> None:
        self.cfg = cfg
        self._secret = secret
        self._prefix = shm.job_prefix(cfg.run_id)
        self.catalog = Catalog(cfg.run_id, cfg.node_id, cfg.owner_pid)
        self._epoch = ""
        self._base = -1  # the step the current epoch resumed from
        self._committed = -1
        self._dead: set[int] = set()  # uncommitted steps of the epoch that can never commit
        self._durable: int | None = None  # newest durable step, while replication runs
        self._durable_since = 0.0
        self._source = ""  # where the epoch's ranks restored from
        self._durable_warned = False
        self._world_size = 0
        self._coord = (Client(cfg.coordinator, secret, cfg.run_id, f"store:{cfg.node_id}",
                              peer="coordinator", hint=COORDINATOR_HINT)
                       if cfg.coordinator else None)
        # Without a coordinator this node is the whole job: the same commit and target rules
        # run here (nothing to wait for at the end: every rank reports to this store).
        self._local = CommitTracker(final_settle_s=0.0) if self._coord is None else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-persist")
        self._warmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-import")
        self._pin_lock = threading.Lock()
        self._pinned: set[str] = set()  # segments of a persist target not copied out yet
        self._hashers = ThreadPoolExecutor(max_workers=cfg.threads or default_threads(),
                                           thread_name_prefix="ftrun-verify")
        self._pending_write: Future[None] | None = None
        self._writing_step: int | None = None
        self._persisted_step: int | None = None
        self._handled: dict[int, str] = {}  # persist target -> what became of it (this epoch)
        self._cadence: dict[int, tuple[int, int]] = {}  # rank -> (snapshots skipped, interval)
        self._final: int | None = None  # the epoch's final target, once known
        self._report_due = False  # tell the coordinator about targets done, at once
        self._restarted = True  # until the first reply: older targets were handled before
        self._stop = threading.Event()
        self._persist_now = threading.Event()
        self._unlink_at_exit = False
        self._replication: Any = None  # ftrun.store.replica.Replication, with --replicas > 1
        self._shards: Any = None  # ftrun.store.shards.ShardService

    # -- segments (the catalog finds, opens and adopts them) --------------------------------
    def _open(self, name: str) -> shm.Segment | None:
        return self.catalog.open(name)

    def _job_segments(self) -> list[str]:
        return self.catalog.names()

    @staticmethod
    def _rank_of(name: str) -> tuple[int, int]:
        return rank_of(name)

    def _verify_staged(self, name: str, expect_step: int | None = None) -> tuple[bool, str, int]:
        seg = self._open(name)
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
                seg.hashes(h)
                hx = h.hashes_xxh3
            else:  # staged without its hashes: take them here
                hx = seg.write_hashes(verify.hash_chunks(seg.data(h), h.chunk_size,
                                                         self._hashers))
        except IntegrityError as e:
            # That shard can never be part of a commit: say so, so that the step counts as
            # dead and no rank's buffer waits for it.
            if h.epoch:
                self._ask_epoch("snap_verified", {
                    "node_id": self.cfg.node_id, "epoch": h.epoch, "rank": self._rank_of(name)[0],
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
        if not self._world_size:
            self._world_size = int(doc["world_size"])
        rank, _ = self._rank_of(name)
        self._report_verified(h.epoch, rank, h.step, h.data_len)
        return True, "", h.step

    # -- coordinator ------------------------------------------------------------------------
    def _ask(self, kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if self._local is not None:
            reply, _ = self._local.handle(kind, body)
            for t in self._local.new_targets:
                log.info("persist target: step %d (%s%s)", t.step, t.reason,
                         ", final" if t.final else "")
            self._local.new_targets.clear()
            return reply
        assert self._coord is not None
        try:
            msg = self._coord.request(kind, body, "commit_info", COORDINATOR_TIMEOUT_S)
        except (UnreachableError, FtrunError) as e:
            log.warning("coordinator: %s", e)
            return None
        return msg.body

    def _epoch_body(self, epoch: str, base_step: int) -> dict[str, Any]:
        body: dict[str, Any] = {"node_id": self.cfg.node_id, "epoch": epoch,
                                "base_step": base_step, "world_size": self._world_size}
        if self._source:
            body["source"] = self._source
        if self.cfg.persist.dir:
            # The coordinator schedules targets with these (every store passes the same).
            body["persist_every"] = self.cfg.persist.every
            body["persist_interval_s"] = float(self.cfg.persist.interval_s)
        return body

    def _ask_epoch(self, kind: str, body: dict[str, Any], epoch: str) -> dict[str, Any] | None:
        """``_ask`` about the current epoch; a coordinator that lost it (restarted) is taught
        it again, with every shard verified here, and asked once more."""
        info = self._ask(kind, body)
        if info is not None and not info["known"] and epoch == self._epoch:
            self._reteach()
            info = self._ask(kind, body)
        self._note_commit(info, epoch)
        return info

    def _reteach(self) -> None:
        if not self._world_size:
            return  # nothing verified here yet: nothing to teach
        self._ask("snap_epoch", self._epoch_body(self._epoch, max(self._committed, 0)))
        held = []
        for name in self._job_segments():
            seg = self._open(name)
            if seg is None:
                continue
            h = seg.header()
            if h.state == shm.VERIFIED and h.epoch == self._epoch:
                held.append((h.step, self._rank_of(name)[0], h.data_len))
        # Oldest first, as they were verified: a rank's newer shard reported before its older
        # one would make the older step look passed over (dead).
        for step, rank, nbytes in sorted(held):
            self._ask("snap_verified", {"node_id": self.cfg.node_id, "epoch": self._epoch,
                                        "rank": rank, "step": step, "nbytes": nbytes})
        if self._replication is not None:
            self._replication.reteach()  # and the replicas of peers' shards held here

    def _note_commit(self, info: dict[str, Any] | None, epoch: str) -> None:
        """Take in a commit_info reply: the committed step, then the persist targets.

        Targets are handled here, before the reply can let any claim through: a rank only
        overwrites a target's buffer after the next step committed, which this very reply
        may be the first to say.
        """
        if not (info and info.get("known") and info["epoch"] == epoch == self._epoch):
            return
        if info["committed"] > self._committed and self._replication is not None:
            self._replication.sender.wake()
        self._committed = max(self._committed, info["committed"])
        self._note_durable(info.get("durable"))
        self._dead = set(info.get("dead") or ())
        if info.get("final") is not None:
            self._final = info["final"]
        targets = sorted(info.get("targets") or ())
        if self._restarted:
            # A store restarted mid-epoch: the older targets were written (or given up) by
            # the store before it, and their buffers are gone by now.
            self._restarted = False
            for step in targets[:-1]:
                self._handled.setdefault(step, "before this store started")
        for step in targets:
            if self._due(step):
                self._persist_target(step)

    def _report_verified(self, epoch: str, rank: int, step: int, nbytes: int) -> None:
        if not epoch:
            return
        self._ask_epoch("snap_verified", {"node_id": self.cfg.node_id, "epoch": epoch,
                                          "rank": rank, "step": step, "nbytes": nbytes}, epoch)

    def _note_durable(self, durable: int | None) -> None:
        """Follow the newest durable step (None: no replication running, nothing to keep)."""
        now = time.monotonic()
        if durable is None:
            self._durable = None
            return
        if self._durable is None or durable > self._durable:
            self._durable, self._durable_since = durable, now

    def _durable_kept(self, need: int) -> bool:
        """Whether a rank whose newest shard is step ``need`` may overwrite its older buffer
        without losing the newest durable step: yes once ``need`` is durable itself. While
        replication is behind, the older buffer (the durable step) is kept and the ranks skip
        snapshots, for at most DURABLE_KEEP_S: a host lost meanwhile still restores from
        memory. Past that, replication is too slow to wait for: local snapshots go on (a
        crash restores the newest step; a lost host an older durable one, or the disk)."""
        if self._durable is None or self._durable >= need or need <= self._base:
            return True  # (the step an epoch resumed from is kept as it was)
        behind = time.monotonic() - self._durable_since
        if behind <= DURABLE_KEEP_S:
            return False
        if not self._durable_warned:
            self._durable_warned = True
            log.warning("replication is %.0f s behind (durable step %d, committed %d): "
                        "snapshots no longer wait for it; a lost host restores from an older "
                        "durable step or from disk. Raise --replica-rate or lower "
                        "--snapshot-every", behind, self._durable, self._committed)
        return True

    def _claim(self, epoch: str, need: int) -> ClaimAnswer | None:
        """Whether a rank whose newest shard is step ``need`` may write its next snapshot:
        "older" (``need`` committed: overwrite the older buffer), "newest" (``need`` is dead:
        overwrite that shard, the older buffer keeps the last committed step) or None."""
        for ask in (False, True):
            if ask:
                self._ask_epoch("commit_query", {"epoch": epoch}, epoch)
            if epoch != self._epoch:
                return None
            if self._committed >= need and self._durable_kept(need):
                return ClaimAnswer.OLDER
            if need in self._dead:
                return ClaimAnswer.NEWEST
        return None

    def request_persist(self, reason: str, final: bool = False) -> dict[str, Any] | None:
        """Ask for a persist target now (every node's store then writes that step)."""
        if not self._epoch:
            log.info("persist (%s): no snapshot epoch yet, nothing committed to write", reason)
            return None
        body = {"node_id": self.cfg.node_id, "epoch": self._epoch, "reason": reason,
                "final": final}
        deadline = time.monotonic() + FINAL_SETTLE_S + 2 * COORDINATOR_TIMEOUT_S
        while True:
            info = self._ask_epoch("persist_request", body, self._epoch)
            if not (info and info.get("settling")) or time.monotonic() > deadline:
                return info
            time.sleep(0.1)

    # -- requests from ranks ----------------------------------------------------------------
    def handle(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        """Answer one request from a rank: what the server's handler table runs."""
        handler = self._handlers().get(msg.kind)
        if handler is None:
            raise ProtocolError(f"the store does not accept {msg.kind!r}")
        return handler(msg)

    def _handlers(self) -> dict[str, Any]:
        return {
            "snap_staged": self._on_staged,
            "snap_claim": self._on_claim,
            "snap_flush": self._on_flush,
            "snap_restored": self._on_restored,
            "store_persist": self._on_persist,
            "catalog_request": self._on_catalog,
            "fault_corrupt": self._on_fault_corrupt,
            "stores_request": self._on_stores,
        }

    def _follow_ranks(self, b: dict[str, Any]) -> None:
        if b["epoch"] != self._epoch and "base" in b:
            self._follow_epoch(b["epoch"], b["base"])

    def _on_staged(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        self._follow_ranks(b)
        if "every" in b:
            self._cadence[b["rank"]] = (b.get("skipped", 0), b["every"])
        name = self.catalog.buffer_name(b["rank"], b["buffer"])
        ok, reason, _ = self._verify_staged(name, b["step"])
        if not ok:
            log.error("rank %d step %d not verified: %s", b["rank"], b["step"], reason)
        body = {"rank": b["rank"], "buffer": b["buffer"], "step": b["step"], "ok": ok,
                "committed": self._committed}
        if reason:
            body["reason"] = reason[:1000]
        return "snap_done", body

    def _on_claim(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        self._follow_ranks(b)
        # Everything staged is verified first: a claim must never race the hashing.
        self._verify_rank(b["rank"])
        if self._pinned_buffer(self.catalog.buffer_name(b["rank"], b["buffer"])):
            # It holds a persist target still being copied out: not now (the rank skips
            # this snapshot; it never waits).
            return "snap_claim_reply", {"ok": False, "committed": self._committed}
        which = self._claim(b["epoch"], b["need_committed"])
        reply = {"ok": which is not None, "committed": self._committed}
        if which == ClaimAnswer.NEWEST:
            reply["buffer"] = 1 - b["buffer"]
        return "snap_claim_reply", reply

    def _on_flush(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        self._verify_rank(b["rank"])
        return "ack", {"re": msg.id}

    def _on_restored(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        if b["epoch"] != self._epoch:
            self._begin_epoch(b["epoch"], b["step"], restarted=False)
            self._world_size = b["world_size"]
            self._source = b.get("source") or ""
            self._ask("snap_epoch", self._epoch_body(b["epoch"], b["step"]))
        return "ack", {"re": msg.id}

    def _on_persist(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        self.request_persist(b["reason"])
        return "ack", {"re": msg.id}

    def _on_catalog(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        records = self.catalog.records(b.get("rank"))
        if b.get("replicas") and self._replication is not None:
            records += [r for r in self._replication.receiver.records()
                        if b.get("rank") is None or r.rank == b["rank"]]
        return "catalog_reply", {"node_id": self.cfg.node_id, "records": [
            r.to_json(with_hashes=bool(b.get("hashes"))) for r in records]}

    def _on_stores(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        """The job's live stores' shard services, as the coordinator knows them (this store's
        own at least): where a restoring rank looks for shards (ftrun.store.shards)."""
        stores: dict[str, str] = {}
        if self._coord is not None:
            try:
                reply = self._coord.request("stores_request", {}, "stores_reply",
                                            COORDINATOR_TIMEOUT_S)
                stores = {s["node_id"]: s["addr"] for s in reply.body["stores"]}
            except (UnreachableError, FtrunError) as e:
                log.warning("coordinator did not list the job's stores (%s): a restore reads "
                            "this node's shards only", e)
        if self._shards is not None:
            stores[self.cfg.node_id] = self._shards.address
        return "stores_reply", {"stores": [{"node_id": n, "addr": a}
                                           for n, a in sorted(stores.items())]}

    def _on_fault_corrupt(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        return "fault_reply", self._corrupt(b["rank"])

    def _corrupt(self, rank: int) -> dict[str, Any]:
        """Fault injection: flip one byte in the middle of ``rank``'s newest verified shard,
        leaving its state and hashes as they are (silent corruption)."""
        shards = [r for r in self.catalog.records(rank) if r.state == SegmentState.VERIFIED]
        if not shards:
            raise FtrunError(f"this store holds no verified shard of rank {rank} to corrupt; "
                             "retry once a snapshot of it has been verified")
        newest = max(shards, key=lambda r: r.step)
        seg = self.catalog.open(newest.segment)
        assert seg is not None
        h = seg.header()
        offset = h.data_len // 2
        seg.mm[h.data_off + offset] ^= 0xFF
        log.warning("fault injection: flipped byte %d of rank %d's shard of step %d (%s)",
                    offset, rank, h.step, newest.segment)
        return {"segment": newest.segment, "step": h.step, "offset": offset}

    def _begin_epoch(self, epoch: str, base: int, restarted: bool) -> None:
        self._epoch, self._committed, self._base = epoch, base, base
        self._durable, self._durable_warned = None, False
        self._dead = set()
        self._handled.clear()
        self._final = None
        self._restarted = restarted
        self._report_due = True

    def _follow_epoch(self, epoch: str, base: int) -> None:
        """A rank speaks of an epoch this store never heard begin: the store was restarted
        after the workers' restore (it guessed its epoch from old segments). The ranks' epoch
        is the current one; take it, with the step it resumed from, and teach it onwards."""
        log.info("following the ranks into snapshot epoch %s (resumed from step %d; this store "
                 "had %s)", epoch, base, self._epoch or "none")
        self._begin_epoch(epoch, base, restarted=True)
        self._reteach()
        self._ask_epoch("commit_query", {"epoch": epoch}, epoch)

    def _verify_rank(self, rank: int) -> None:
        for buffer in (0, 1):
            name = self.catalog.buffer_name(rank, buffer)
            seg = self._open(name)
            if seg is not None and seg.header().state == shm.STAGED:
                self._verify_staged(name)

    def _verify_all(self) -> None:
        for name in self._job_segments():
            seg = self._open(name)
            if seg is not None and seg.header().state == shm.STAGED:
                self._verify_staged(name)

    # -- persistence ------------------------------------------------------------------------
    def _persist_target(self, step: int) -> None:
        """Copy this node's shards of target ``step`` out of shared memory and write them to
        disk, in the background (off the message loop). Until its copy is taken, no rank may
        overwrite a shard of the target: its claims are refused (the rank skips a snapshot
        rather than wait).

        If the previous write is still running, the disk is behind: this target is skipped
        here (logged), never waited for, except the final one (the job is ending, the
        buffers no longer change).
        """
        if not self.cfg.persist.dir:
            return
        final = step == self._final
        self._report_due = True
        while len(self._handled) >= 4 * MAX_TARGETS:
            del self._handled[min(self._handled)]
        if step <= 0:
            self._handled[step] = "nothing to write"
            return
        busy = self._pending_write is not None and not self._pending_write.done()
        if busy and not final:
            self._handled[step] = "skipped: disk behind"
            log.warning("not persisting step %d here: the write of step %s is still running "
                        "(the disk is behind; step %d will be partial on disk and pruned)",
                        step, self._writing_step, step)
            return
        if busy:
            assert self._pending_write is not None
            self._pending_write.result(timeout=WRITE_TIMEOUT_S)
        names, missing = self._locate_step(step)
        if missing and step == self._base and not names:
            # The epoch began there, restored from disk (or written before a restart).
            self._handled[step] = "the epoch's base step"
            log.info("persist target %d is the step this epoch resumed from; nothing newer "
                     "to write here", step)
            return
        if missing:
            self._handled[step] = f"not held: {missing}"
            log.error("cannot persist step %d: %s; it stays partial on disk", step, missing)
            return
        self._handled[step] = "written"
        log.info("persisting step %d%s: %d shard(s)", step, " (final)" if final else "",
                 len(names))
        with self._pin_lock:
            self._pinned.update(names)
        self._writing_step = step
        self._pending_write = self._writer.submit(self._copy_and_write, step, names)

    def _due(self, step: int) -> bool:
        """Whether target ``step`` still needs handling here: never handled, or skipped
        while the disk was behind and now the final target (which is waited for)."""
        outcome = self._handled.get(step)
        return outcome is None or (step == self._final and outcome.startswith("skipped"))

    def _locate_step(self, step: int) -> tuple[list[str], str]:
        """The segments holding every local rank's verified shard of ``step`` (rank order),
        or why some rank has none."""
        held: dict[int, str] = {}
        ranks: set[int] = set()
        for name in self._job_segments():
            rank, _ = self._rank_of(name)
            ranks.add(rank)
            seg = self._open(name)
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

    def _pinned_buffer(self, name: str) -> bool:
        with self._pin_lock:
            return name in self._pinned

    def _copy_shards(self, step: int, names: list[str]) -> tuple[list[Shard], str]:
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
                    self._pinned.discard(name)
        return shards, "; ".join(problems)

    def _copy_and_write(self, step: int, names: list[str]) -> None:
        try:
            shards, problem = self._copy_shards(step, names)
        finally:
            with self._pin_lock:
                self._pinned.difference_update(names)
        if problem:
            self._handled[step] = f"not held: {problem}"
            self._report_due = True
            log.error("cannot persist step %d: %s; it stays partial on disk", step, problem)
            return
        self._write(step, shards)

    def _write(self, step: int, shards: list[Shard]) -> None:
        from ftrun.snapshot import persist

        assert self.cfg.persist.dir
        root = Path(self.cfg.persist.dir)
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
                persist.prune(root, self.cfg.persist.keep)
        except Exception:
            log.exception("persisting step %d failed", step)
            return
        finally:
            self._report_due = True
        self._persisted_step = step
        log.info("persisted step %d to %s in %.2f s", step, root, time.perf_counter() - t0)

    def _writing(self) -> int | None:
        """The target being written now (None: the writer is idle)."""
        job = self._pending_write
        return self._writing_step if job is not None and not job.done() else None

    def _persist_final(self) -> None:
        """At the end (job end, SIGTERM): write the final target every node agreed on."""
        if not self.cfg.persist.dir or not self._epoch:
            return
        info = self.request_persist("end of job", final=True)
        if info is None and self._coord is not None:
            # Nobody to agree with: the newest step this node knows committed is the best
            # left; another node may write a different one (that step then stays partial).
            log.warning("coordinator unreachable: persisting step %d, the newest known "
                        "committed here; other nodes may write another step", self._committed)
            self._final = self._committed
            self._persist_target(self._committed)
        elif info is not None and info.get("settling"):
            log.warning("no final step agreed within %.0f s; not persisting at the end",
                        FINAL_SETTLE_S + 2 * COORDINATOR_TIMEOUT_S)
        elif self._final is not None and self._due(self._final):
            self._persist_target(self._final)
        if self._pending_write is not None:
            self._pending_write.result(timeout=WRITE_TIMEOUT_S)

    # -- loop -------------------------------------------------------------------------------
    def adopt(self) -> None:
        removed = shm.clean_leftovers(keep_prefix=self._prefix)
        if removed:
            log.info("removed %d segment(s) of jobs that are gone: %s", len(removed),
                     ", ".join(removed[:5]))
        for name in self._job_segments():
            seg = self._open(name)
            if seg is None:
                continue
            h = seg.header()
            if h.epoch and not self._epoch:
                self._epoch = h.epoch
            if h.state == shm.STAGED:
                self._verify_staged(name)
            elif h.state == shm.VERIFIED and not self._world_size:
                try:
                    self._world_size = int(parse_manifest(seg.manifest_bytes(h))["world_size"])
                except (IntegrityError, KeyError, ValueError):
                    pass
        if self._job_segments():
            log.info("adopted %d segment(s) of job %s", len(self._job_segments()), self.cfg.run_id)

    def report(self, final: bool = False) -> None:
        names = self._job_segments()
        total = 0
        ranks = set()
        for name in names:
            try:
                total += self.catalog.nbytes(name)
                ranks.add(self._rank_of(name)[0])
            except (OSError, ValueError):
                continue
        if self._replication is not None:
            total += self._replication.receiver.nbytes()  # peers' replicas held here
        if self._coord is not None:
            extra = self._replication.report_fields() if self._replication is not None else {}
            if self._shards is not None:
                extra["shard_addr"] = self._shards.address
            try:
                reply = self._coord.request("store_report", {
                    "node_id": self.cfg.node_id, "bytes": total, "segments": len(names),
                    "persisted_step": self._persisted_step, "ranks": sorted(ranks),
                    "persist": bool(self.cfg.persist.dir), "final": final,
                    "epoch": self._epoch or None, "writing": self._writing(),
                    "target_done": max(self._handled, default=-1),
                    "skipped": sum(s for s, _ in self._cadence.values()),
                    "every": max((k for _, k in self._cadence.values()), default=None),
                    **extra,
                }, None, COORDINATOR_TIMEOUT_S)
                if reply.kind == "replica_plan" and self._replication is not None:
                    self._replication.set_plan(reply.body)
            except (UnreachableError, FtrunError) as e:
                log.debug("store report: %s", e)

    def _poll(self) -> None:
        """Learn targets while the ranks are quiet (no verify replies to carry them)."""
        if self.cfg.persist.dir and self._epoch and self._coord is not None:
            self._ask_epoch("commit_query", {"epoch": self._epoch}, self._epoch)

    def serve(self) -> None:
        # Ranks' requests, one at a time between the loop's own work; data frames may be
        # chunk-sized.
        server = Server("snapshot store", self._secret, self.cfg.run_id, self._handlers(),
                        sender="store", max_frame_bytes=protocol.MAX_FRAME_BYTES)
        server.bind(self.cfg.url)
        if self.cfg.persist.dir:
            # Import the writer's modules now (seconds), not at the first target's write.
            # On a thread of its own: the writer must be free at once to copy a target out
            # of the buffers it pins (ranks skip snapshots while it holds them).
            self._warmer.submit(_warm_up)
        self.adopt()
        self._start_replication()
        self._start_shards()
        log.info("snapshot store of job %s at %s", self.cfg.run_id, self.cfg.url)
        last_report = last_poll = 0.0
        try:
            while not self._stop.is_set():
                try:
                    server.serve_once(POLL_MS / 1000, max_messages=1)
                    if self._persist_now.is_set():
                        self._persist_now.clear()
                        if self.cfg.persist.dir:
                            self.request_persist("SIGUSR1")
                        else:
                            log.info("SIGUSR1: no --persist-dir, nothing to write")
                    now = time.monotonic()
                    if now - last_poll >= POLL_TARGETS_S:
                        last_poll = now
                        self._poll()
                    if now - last_report >= REPORT_EVERY_S or (
                            self._report_due and self._writing() is None):
                        last_report = now
                        self._report_due = False
                        self.report()
                except Exception:  # noqa: BLE001 - the store must survive anything
                    log.exception("store loop error; continuing")
                    time.sleep(POLL_MS / 1000)
        finally:
            # No claim is answered from here on: the buffers stay as they are.
            server.close()
            self._shutdown()

    def _start_replication(self) -> None:
        """Start the replica sender and receiver; the receiver first adopts the replicas a
        previous store of this node held (it crashed and the launcher restarted it) and
        reports them to the coordinator again."""
        if self.cfg.replicas <= 1:
            return
        if self.cfg.coordinator is None:
            log.warning("replicas are off: this job has no coordinator, so no peer node to "
                        "hold them (--replicas %d); snapshots stay on this node only",
                        self.cfg.replicas)
            return
        from ftrun.store.replica import ReplicaConfig, Replication

        rep = Replication(
            ReplicaConfig(self.cfg.replicas, self.cfg.replica_host,
                          self.cfg.replica_rate_mb_s * 1e6),
            self.cfg.run_id, self.cfg.node_id, self.cfg.owner_pid, self._secret,
            lambda: (self._epoch, self._committed), self.cfg.coordinator)
        try:
            rep.start()
        except Exception:  # noqa: BLE001 - the ranks' snapshots go on without replicas
            log.exception("replication could not start (--replica-addr %s); snapshots stay "
                          "on this node only", self.cfg.replica_host)
            rep.stop(unlink=True)
            return
        self._replication = rep

    def _start_shards(self) -> None:
        from ftrun.store.shards import ShardService

        rep = self._replication
        service = ShardService(self.cfg.run_id, self.cfg.node_id, self.cfg.owner_pid,
                               self._secret, rep.receiver.records if rep is not None else None)
        try:
            service.start(self.cfg.replica_host)
        except Exception:  # noqa: BLE001 - restores then read this node's memory only
            log.exception("the shard service could not start on %s; other nodes cannot read "
                          "this node's snapshots", self.cfg.replica_host)
            service.stop()
            return
        self._shards = service

    def persist_on_signal(self) -> None:
        """SIGUSR1: the serve loop asks for a persist target at its next turn."""
        self._persist_now.set()

    def stop(self, unlink: bool) -> None:
        self._unlink_at_exit = unlink
        self._stop.set()

    def _shutdown(self) -> None:
        if self._unlink_at_exit:
            try:
                # Steps the ranks staged just before stopping may still commit.
                self._verify_all()
                held = self.catalog.held_steps()
                log.info("stopping; verified steps held here: %s", " ".join(
                    f"rank{r}={','.join(map(str, steps)) or '-'}" for r, steps in held.items())
                    or "none")
                self._persist_final()
            except Exception:
                log.exception("final persist failed")
        self._writer.shutdown(wait=True)
        self._hashers.shutdown(wait=True)
        self._warmer.shutdown(wait=False)
        if self._shards is not None:
            self._shards.stop()
            self._shards = None
        if self._replication is not None:
            self._replication.stop(unlink=self._unlink_at_exit)
            self._replication = None
        if self._unlink_at_exit:
            self.report(final=True)
        self.catalog.close()
        if self._unlink_at_exit:
            self.catalog.unlink_all()
            log.info("removed the job's snapshot segments")
        if self._coord is not None:
            self._coord.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftrun.store.store")
    p.add_argument("--config", required=True, help="JSON StoreConfig")
    args = p.parse_args(argv)
    set_parent_death_signal(signal.SIGKILL)
    cfg = StoreConfig.from_json(json.loads(args.config))
    if os.getppid() != cfg.owner_pid:
        return 1  # the launcher is already gone
    logging.basicConfig(level=knobs.LOG_LEVEL.get().upper(), stream=sys.stderr,
                        format="[ftrun-store %(asctime)s %(levelname)s] %(message)s",
                        datefmt="%H:%M:%S")
    secret = knobs.SECRET.get().encode() or jobs.load_secret(cfg.run_id, create=False)
    store = SnapshotStore(cfg, secret)
    def on_signal(sig: int) -> None:
        if sig == signal.SIGUSR1:
            store.persist_on_signal()
        else:
            store.stop(unlink=True)

    relay = SignalRelay(on_signal, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1).start()
    try:
        store.serve()
    finally:
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
