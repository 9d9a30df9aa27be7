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
- **follow the coordinator**: when it fails over (``--rdzv-backend etcd``) the launcher says
  where it went (``coordinator_moved``); the store reports there from then on and teaches
  the new coordinator what it holds at once (its report, the epoch's verified shards, the
  replicas of peers' shards), so commits, durable steps and replica plans carry on;
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ftrun import jobs, knobs, protocol
from ftrun.coordinator.client import HINT as COORDINATOR_HINT
from ftrun.coordinator.commits import FINAL_SETTLE_S
from ftrun.errors import FtrunError, IntegrityError, UnreachableError
from ftrun.pdeath import set_parent_death_signal
from ftrun.protocol import messages as m
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Client, Server
from ftrun.sigrelay import SignalRelay
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import parse_manifest
from ftrun.store.api import StoreConfig
from ftrun.store.catalog import Catalog, buffer_of, rank_of
from ftrun.store.commits import COORDINATOR_TIMEOUT_S, CommitMirror
from ftrun.store.handlers import StoreHandlers
from ftrun.store.persist_writer import PersistWriter
from ftrun.store.survey import Surveyor
from ftrun.store.verifier import Verifier

__all__ = ["SnapshotStore", "StoreConfig", "default_threads", "main"]

log = logging.getLogger("ftrun.store")

POLL_MS = 100
REPORT_EVERY_S = 2.0
POLL_TARGETS_S = 1.0


def default_threads() -> int:
    """Hashing threads the store may use: what a node of training ranks can spare."""
    return max(2, min(8, (os.cpu_count() or 2) // 8))


def _warm_up() -> None:
    from ftrun.snapshot import persist

    persist.import_dcp()


class SnapshotStore:
    """The store process's service: it wires its parts (catalog, verifier, commit mirror,
    persist writer, handlers, replication, shard service), runs the loop and shuts down."""

    def __init__(self, cfg: StoreConfig, secret: bytes) -> None:
        self.cfg = cfg
        self._secret = secret
        self._prefix = shm.job_prefix(cfg.run_id)
        self.catalog = Catalog(cfg.run_id, cfg.node_id, cfg.owner_pid)
        self._coord = (Client(cfg.coordinator, secret, cfg.run_id, f"store:{cfg.node_id}",
                              peer="coordinator", hint=COORDINATOR_HINT,
                              term=cfg.coordinator_term)
                       if cfg.coordinator else None)
        self._moved = False  # the coordinator failed over: teach the new one at the next tick
        self._hashers = ThreadPoolExecutor(max_workers=cfg.threads or default_threads(),
                                           thread_name_prefix="ftrun-verify")
        self.persister = PersistWriter(cfg.persist, self.catalog, self._hashers)
        self.commits = CommitMirror(cfg, self._coord, self.catalog, self.persister)
        # ec:K+M keeps each durable step's buffers as replicas do (from the first step on)
        self.commits.erasure = bool(cfg.ec_k and cfg.coordinator)
        self.verifier = Verifier(cfg.node_id, self.catalog, self._hashers, self.commits)
        self.handlers = StoreHandlers(cfg, self.catalog, self.commits, self.verifier,
                                      self.persister, self._coord)
        self.handlers.surveyor = Surveyor(self._secret, cfg.run_id, cfg.node_id,
                                          self.handlers.job_stores)
        self._warmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-import")
        self._stop = threading.Event()
        self._persist_now = threading.Event()
        self._unlink_at_exit = False
        self._replication: Any = None  # ftrun.store.replica.Replication, with --replicas > 1
        self._erasure: Any = None  # ftrun.store.ec_store.ErasureCoding, with ec:K+M
        self._shards: Any = None  # ftrun.store.shards.ShardService
        self._service: Service | None = None  # the ranks' server, once serve() runs
        self._last_report = self._last_poll = 0.0  # when the loop last did each

    def handle(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        """Answer one request from a rank: what the server's handler table runs."""
        return self.handlers.handle(msg)

    def _persist_final(self) -> None:
        """At the end (job end, SIGTERM): write the final target every node agreed on."""
        commits, writer = self.commits, self.persister
        if not self.cfg.persist.dir or not commits.epoch:
            return
        info = commits.request_persist("end of job", final=True)
        if info is None and self._coord is not None:
            # Nobody to agree with: the newest step this node knows committed is the best
            # left; another node may write a different one (that step then stays partial).
            log.warning("coordinator unreachable: persisting step %d, the newest known "
                        "committed here; other nodes may write another step", commits.committed)
            writer.final = commits.committed
            writer.persist_target(commits.committed, commits.base)
        elif info is not None and info.get("settling"):
            log.warning("no final step agreed within %.0f s; not persisting at the end",
                        FINAL_SETTLE_S + 2 * COORDINATOR_TIMEOUT_S)
        elif writer.final is not None and writer.due(writer.final):
            writer.persist_target(writer.final, commits.base)
        writer.wait()

    # -- loop -------------------------------------------------------------------------------
    def adopt(self) -> None:
        removed = shm.clean_leftovers(keep_prefix=self._prefix)
        if removed:
            log.info("removed %d segment(s) of jobs that are gone: %s", len(removed),
                     ", ".join(removed[:5]))
        commits = self.commits
        todo: list[tuple[int, int, str, str]] = []  # (step, state, name, epoch)
        for name in self.catalog.names():
            seg = self.catalog.open(name)
            if seg is None:
                continue
            h = seg.header()
            if h.epoch and not commits.epoch:
                commits.epoch = h.epoch
            if h.state == shm.STAGED or (h.state == shm.VERIFIED and buffer_of(name)):
                todo.append((h.step, h.state, name, h.epoch))
            if h.state == shm.VERIFIED and not commits.world_size:
                try:
                    commits.world_size = int(parse_manifest(seg.manifest_bytes(h))["world_size"])
                except (IntegrityError, KeyError, ValueError):
                    pass
        # Oldest first, as they were verified (a rank's newer shard reported before its older
        # one would make the older step look passed over). Staged ones are verified now; the
        # ranks' verified ones are reported again, since the previous store may have died
        # before its report of them reached the coordinator.
        for _, state, name, epoch in sorted(todo):
            if state == shm.STAGED:
                self.verifier.verify_staged(name)
            elif epoch == commits.epoch:
                self.verifier.report_again(name)
        if self.catalog.names():
            log.info("adopted %d segment(s) of job %s", len(self.catalog.names()),
                     self.cfg.run_id)

    def report(self, final: bool = False) -> None:
        names = self.catalog.names()
        total = 0
        ranks = set()
        for name in names:
            try:
                total += self.catalog.nbytes(name)
                ranks.add(rank_of(name)[0])
            except (OSError, ValueError):
                continue
        if self._replication is not None:
            total += self._replication.receiver.nbytes()  # peers' replicas held here
        if self._erasure is not None:
            total += self._erasure.segments.nbytes()  # parity fragments and rebuilt shards
        if self._coord is not None and (final or not self.commits.coordinator_quiet()):
            extra = self._replication.report_fields() if self._replication is not None else {}
            if self._shards is not None:
                extra["shard_addr"] = self._shards.address
            if self._erasure is not None:
                extra.update(self._erasure.report_fields())
            writer, cadence = self.persister, self.handlers.cadence
            try:
                reply = self._coord.request("store_report", {
                    "node_id": self.cfg.node_id, "bytes": total, "segments": len(names),
                    "persisted_step": writer.persisted_step, "ranks": sorted(ranks),
                    "persist": bool(self.cfg.persist.dir), "final": final,
                    "epoch": self.commits.epoch or None, "writing": writer.writing(),
                    "target_done": max(writer.handled, default=-1),
                    "skipped": sum(s for s, _ in cadence.values()),
                    "blocked_s": round(max(self.handlers.blocked.totals().values(),
                                           default=0.0), 4),
                    "skip_reasons": self.handlers.skip_reasons.totals(),
                    "every": max((k for _, k in cadence.values()), default=None),
                    **extra,
                }, None, COORDINATOR_TIMEOUT_S)
                if reply.kind == "replica_plan" and self._replication is not None:
                    self._replication.set_plan(reply.body)
                self.commits.coordinator_answered()
            except UnreachableError as e:
                log.debug("store report: %s", e)
                self.commits.coordinator_unanswered()
            except FtrunError as e:
                log.debug("store report: %s", e)

    def _poll(self) -> None:
        """Report again what the coordinator left unanswered; learn targets while the ranks
        are quiet (no verify replies to carry them)."""
        epoch = self.commits.epoch
        self.commits.resend_unreported()
        if self.cfg.persist.dir and epoch and self._coord is not None:
            self.commits.ask_epoch("commit_query", {"epoch": epoch}, epoch)

    def serve(self) -> None:
        # Ranks' requests, one at a time between the loop's own work (_tick); data frames
        # may be chunk-sized.
        table = {**self.handlers.table(), "coordinator_moved": self._on_coordinator_moved}
        self._service = service = Service(
            Server("snapshot store", self._secret, self.cfg.run_id, table,
                   sender="store", max_frame_bytes=protocol.MAX_FRAME_BYTES, typed=True),
            poll_s=POLL_MS / 1000, max_messages=1, after=self._tick)
        service.bind(self.cfg.url)
        if self.cfg.persist.dir:
            # Import the writer's modules now (seconds), not at the first target's write.
            # On a thread of its own: the writer must be free at once to copy a target out
            # of the buffers it pins (ranks skip snapshots while it holds them).
            self._warmer.submit(_warm_up)
        self.adopt()
        self._start_replication()
        self._start_erasure()
        self._start_shards()
        log.info("snapshot store of job %s at %s", self.cfg.run_id, self.cfg.url)
        try:
            # Serves until stop(); on its way out it closes the socket: no claim is answered
            # from here on, so the buffers stay as they are.
            service.run(self._stop)
        finally:
            self._shutdown()

    def _on_coordinator_moved(self, msg: protocol.Message) -> m.Ack:
        """The launcher says the coordinator failed over: report there from now on."""
        b = msg.body
        if self._coord is None:
            raise FtrunError("this store runs without a coordinator: nothing to move")
        if b.term > self._coord.term:
            log.warning("the coordinator failed over: term %d at %s (was term %d at %s); "
                        "teaching it what this store holds", b.term, b.endpoint,
                        self._coord.term, self._coord.address)
            self._coord.retarget(b.endpoint, b.term)
            if self._replication is not None:
                self._replication.retarget(b.endpoint, b.term)
            if self._erasure is not None:
                self._erasure.retarget(b.endpoint, b.term)
            self._moved = True
        return m.Ack(re=msg.id)

    def _tick(self, _read: int) -> None:
        """The loop's own work after each round: a SIGUSR1's persist, learning targets,
        reporting to the coordinator (everything, to a coordinator that took over)."""
        if self._moved:
            self._moved = False
            self.report()
            if self.commits.epoch:
                self.commits.reteach()
                self.commits.ask_epoch("commit_query", {"epoch": self.commits.epoch},
                                       self.commits.epoch)
        if self._persist_now.is_set():
            self._persist_now.clear()
            if self.cfg.persist.dir:
                self.commits.request_persist("SIGUSR1")
            else:
                log.info("SIGUSR1: no --persist-dir, nothing to write")
        now = time.monotonic()
        if now - self._last_poll >= POLL_TARGETS_S:
            self._last_poll = now
            self._poll()
        writer = self.persister
        if now - self._last_report >= REPORT_EVERY_S or (
                writer.report_due and writer.writing() is None):
            self._last_report = now
            writer.report_due = False
            self.report()

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
            lambda: (self.commits.epoch, self.commits.committed), self.cfg.coordinator,
            self.cfg.coordinator_term,
            durable=lambda: (self.commits.epoch, self.commits.durable_step()))
        try:
            rep.start()
        except Exception:  # noqa: BLE001 - the ranks' snapshots go on without replicas
            log.exception("replication could not start (--replica-addr %s); snapshots stay "
                          "on this node only", self.cfg.replica_host)
            rep.stop(unlink=True)
            return
        self._replication = self.commits.replication = self.handlers.replication = rep

    def _start_erasure(self) -> None:
        """Erasure coding (--redundancy ec:K+M): the parity thread, and the rebuild of lost
        nodes' shards in this store's survey for a restore (ftrun.store.ec_store)."""
        cfg = self.cfg
        if not cfg.ec_k:
            return
        if cfg.coordinator is None:
            log.warning("erasure coding is off: this job has no coordinator, so no peer node "
                        "to build parity with (ec:%d+%d); snapshots stay on this node only",
                        cfg.ec_k, cfg.ec_m)
            return
        from ftrun.store.ec_store import ErasureCoding

        ec = ErasureCoding(cfg.ec_k, cfg.ec_m, cfg.run_id, cfg.node_id, cfg.owner_pid,
                           self._secret, lambda: (self.commits.epoch, self.commits.committed),
                           cfg.coordinator, cfg.coordinator_term,
                           durable=self.commits.note_parity_durable,
                           off=self.commits.parity_off)
        ec.start()
        self._erasure = ec
        self.handlers.surveyor.rebuild = ec.rebuild_lost

    def _rebuilds_refused(self) -> list[dict[str, Any]]:
        erasure = self._erasure
        return erasure.refused_rebuilds() if erasure is not None else []

    def _held_elsewhere(self) -> list[Any]:
        """Records of what this store holds besides its ranks' buffers: replicas, parity
        fragments, rebuilt shards (served by the shard service)."""
        out: list[Any] = []
        if self._replication is not None:
            out += self._replication.receiver.records()
        if self._erasure is not None:
            out += self._erasure.records()
        return out

    def _start_shards(self) -> None:
        from ftrun.store.shards import ShardService

        service = ShardService(self.cfg.run_id, self.cfg.node_id, self.cfg.owner_pid,
                               self._secret, self._held_elsewhere, self._rebuilds_refused)
        try:
            service.start(self.cfg.replica_host)
        except Exception:  # noqa: BLE001 - restores then read this node's memory only
            log.exception("the shard service could not start on %s; other nodes cannot read "
                          "this node's snapshots", self.cfg.replica_host)
            service.stop()
            return
        self._shards = self.handlers.shards = service

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
                self.verifier.verify_all()
                held = self.catalog.held_steps()
                log.info("stopping; verified steps held here: %s", " ".join(
                    f"rank{r}={','.join(map(str, steps)) or '-'}" for r, steps in held.items())
                    or "none")
                self._persist_final()
            except Exception:
                log.exception("final persist failed")
        self.persister.writer.shutdown(wait=True)
        self.handlers.surveyor.close()
        self._hashers.shutdown(wait=True)
        self._warmer.shutdown(wait=False)
        if self._shards is not None:
            self._shards.stop()
            self._shards = self.handlers.shards = None
        if self._replication is not None:
            self._replication.stop(unlink=self._unlink_at_exit)
            self._replication = self.commits.replication = self.handlers.replication = None
        if self._erasure is not None:
            self.handlers.surveyor.rebuild = None
            self._erasure.stop(unlink=self._unlink_at_exit)
            self._erasure = None
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
