"""The node's snapshot store: a process beside the ranks that outlives their restarts.

It does the work the training loop must not wait for:

- **verify**: when a rank has staged a snapshot in its shared-memory buffer, the store
  hashes every tensor (xxh3-64), writes the hash table, marks the buffer VERIFIED and tells
  the coordinator, which commits step S once every rank's shard of S is verified;
- **claims**: before a rank overwrites its older buffer it asks here; the answer is yes only
  once the step in its newer buffer is committed, so the newest committed snapshot is never
  overwritten;
- **persist**: committed snapshots go to disk every N steps or T seconds, on SIGUSR1, and on
  SIGTERM (job end, preemption), off the training path;
- **adopt and clean**: segments are named after the job, so a restarted store picks them up
  (verifying whatever was staged but not yet hashed); segments of dead jobs are removed;
  on SIGTERM, the job's own segments go too.

Run by the launcher as ``python -m ftrun.snapshot.store`` (with a parent-death signal).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
import zmq

from ftrun import jobs, knobs, protocol
from ftrun.errors import FtrunError, IntegrityError, ProtocolError, UnreachableError
from ftrun.launcher.pdeath import set_parent_death_signal
from ftrun.snapshot import segment as shm
from ftrun.snapshot.channel import Channel
from ftrun.snapshot.manifest import entries, parse_manifest

log = logging.getLogger("ftrun.store")

POLL_MS = 100
REPORT_EVERY_S = 2.0
COORDINATOR_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StoreConfig:
    run_id: str
    url: str  # ipc:// endpoint the ranks connect to
    coordinator: str | None
    node_id: str
    owner_pid: int
    persist_dir: str | None = None
    persist_every: int = 0
    persist_interval_s: float = 0.0
    persist_keep: int = 3


def hash_tensors(seg: shm.Segment, doc: dict[str, Any]) -> list[int]:
    data = seg.data()
    out = []
    for e in entries(doc):
        out.append(xxhash.xxh3_64_intdigest(data[e.offset:e.offset + e.nbytes]))
    return out


def verify_segment(seg: shm.Segment) -> tuple[bool, str]:
    """Re-hash a VERIFIED segment against its table: (ok, reason)."""
    try:
        h = seg.header()
        if h.state != shm.VERIFIED:
            return False, f"state {h.state_name}"
        doc = parse_manifest(seg.manifest_bytes(h))
        want = seg.hashes(h)
        got = hash_tensors(seg, doc)
    except (IntegrityError, ValueError, KeyError) as e:
        return False, str(e)
    bad = [e.key for e, a, b in zip(entries(doc), got, want, strict=True) if a != b]
    if bad:
        return False, f"hash mismatch in {len(bad)} tensor(s), first {bad[0]}"
    return True, ""


class SnapshotStore:
    def __init__(self, cfg: StoreConfig, secret: bytes) -> None:
        self.cfg = cfg
        self._secret = secret
        self._prefix = shm.job_prefix(cfg.run_id)
        self._segments: dict[str, tuple[int, shm.Segment]] = {}  # name -> (inode, seg)
        self._epoch = ""
        self._committed = -1
        self._world_size = 0
        self._coord = (Channel(protocol.zmq_url(cfg.coordinator), secret, cfg.run_id,
                               f"store:{cfg.node_id}") if cfg.coordinator else None)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-persist")
        self._pending_write: Future[None] | None = None
        self._persisted_step: int | None = None
        self._last_persist_mono = time.monotonic()
        self._stop = threading.Event()
        self._persist_now = threading.Event()
        self._unlink_at_exit = False

    # -- segments ---------------------------------------------------------------------------
    def _open(self, name: str) -> shm.Segment | None:
        path = shm.SHM_DIR / name
        try:
            st = path.stat()
        except FileNotFoundError:
            self._forget(name)
            return None
        cached = self._segments.get(name)
        if cached and cached[0] == st.st_ino and cached[1].mm.size() == st.st_size:
            return cached[1]
        self._forget(name)
        try:
            seg = shm.Segment.open(path)
        except (OSError, IntegrityError, ValueError) as e:
            log.warning("cannot open segment %s: %s", name, e)
            return None
        self._segments[name] = (st.st_ino, seg)
        return seg

    def _forget(self, name: str) -> None:
        old = self._segments.pop(name, None)
        if old:
            old[1].close()

    def _job_segments(self) -> list[str]:
        """This node's segments of the job: those whose owner is our launcher.

        Several launchers of one job can share a host (and /dev/shm); each store must only
        ever touch its own node's buffers.
        """
        mine = []
        for path in shm.list_segments(self._prefix):
            seg = self._open(path.name)
            if seg is None:
                continue
            h = seg.header()
            if h.owner_pid != self.cfg.owner_pid and not shm.owner_alive(h):
                # Left by a launcher of this job that died (a replaced node, a relaunch):
                # they are ours now.
                seg.set_state(h.state, owner_pid=self.cfg.owner_pid,
                              owner_start=shm.proc_start_ticks(self.cfg.owner_pid))
                log.info("adopted %s (step %d) from dead launcher %d", path.name, h.step,
                         h.owner_pid)
                h = seg.header()
            if h.owner_pid == self.cfg.owner_pid:
                mine.append(path.name)
        return mine

    @staticmethod
    def _rank_of(name: str) -> tuple[int, int]:
        r, b = name.rsplit("-", 2)[-2:]
        return int(r[1:]), int(b[1:])

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
            hashes = hash_tensors(seg, doc)
        except IntegrityError as e:
            return False, str(e), h.step
        hx = seg.write_hashes(hashes)
        # The rank may have begun overwriting meanwhile (it never does without a claim, but
        # check): only mark verified what is still the staged step.
        now = seg.header()
        if now.state != shm.STAGED or now.step != h.step:
            return False, "overwritten while hashing", h.step
        seg.set_state(shm.VERIFIED, hashes_xxh3=hx)
        log.debug("verified %s step %d (%d bytes) in %.1f ms", name, h.step, h.data_len,
                  (time.perf_counter() - t0) * 1e3)
        rank, _ = self._rank_of(name)
        self._report_verified(h.epoch, rank, h.step, h.data_len)
        return True, "", h.step

    # -- coordinator ------------------------------------------------------------------------
    def _ask(self, kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if self._coord is None:
            return None
        try:
            msg = self._coord.request(kind, body, "commit_info", COORDINATOR_TIMEOUT_S)
        except (UnreachableError, FtrunError) as e:
            log.warning("coordinator: %s", e)
            return None
        return msg.body

    def _note_commit(self, info: dict[str, Any] | None, epoch: str) -> None:
        if info and info.get("known") and info["epoch"] == epoch == self._epoch:
            self._committed = max(self._committed, info["committed"])

    def _report_verified(self, epoch: str, rank: int, step: int, nbytes: int) -> None:
        if not epoch:
            return
        info = self._ask("snap_verified", {"node_id": self.cfg.node_id, "epoch": epoch,
                                           "rank": rank, "step": step, "nbytes": nbytes})
        if info is not None and not info["known"] and epoch == self._epoch:
            # The coordinator restarted and lost the epoch: teach it again, then retry.
            self._ask("snap_epoch", {"node_id": self.cfg.node_id, "epoch": epoch,
                                     "base_step": max(self._committed, 0), "world_size":
                                     self._world_size})
            info = self._ask("snap_verified", {"node_id": self.cfg.node_id, "epoch": epoch,
                                               "rank": rank, "step": step, "nbytes": nbytes})
        self._note_commit(info, epoch)
        self._maybe_persist()


    def _committed_at_least(self, epoch: str, step: int) -> bool:
        if epoch == self._epoch and self._committed >= step:
            return True
        if self._coord is None:
            return True  # no coordinator: this node is the whole job; local checks suffice
        self._note_commit(self._ask("commit_query", {"epoch": epoch}), epoch)
        return epoch == self._epoch and self._committed >= step

    # -- requests from ranks ----------------------------------------------------------------
    def handle(self, msg: protocol.Message) -> tuple[str, dict[str, Any]] | None:
        b = msg.body
        if msg.kind == "snap_staged":
            name = shm.segment_name(self.cfg.run_id, b["rank"], b["buffer"])
            ok, reason, _ = self._verify_staged(name, b["step"])
            if not ok:
                log.error("rank %d step %d not verified: %s", b["rank"], b["step"], reason)
            body = {"rank": b["rank"], "buffer": b["buffer"], "step": b["step"], "ok": ok,
                    "committed": self._committed}
            if reason:
                body["reason"] = reason[:1000]
            return "snap_done", body
        if msg.kind == "snap_claim":
            # Everything staged is verified first: a claim must never race the hashing.
            self._verify_rank(b["rank"])
            ok = self._committed_at_least(b["epoch"], b["need_committed"])
            return "snap_claim_reply", {"ok": ok, "committed": self._committed}
        if msg.kind == "snap_flush":
            self._verify_rank(b["rank"])
            return "ack", {"re": msg.id}
        if msg.kind == "snap_restored":
            if b["epoch"] != self._epoch:
                self._epoch, self._committed = b["epoch"], b["step"]
                self._world_size = b["world_size"]
                self._ask("snap_epoch", {"node_id": self.cfg.node_id, "epoch": b["epoch"],
                                         "base_step": b["step"], "world_size": b["world_size"]})
            return "ack", {"re": msg.id}
        if msg.kind == "store_persist":
            self.persist(reason=b["reason"], wait=True)
            return "ack", {"re": msg.id}
        raise ProtocolError(f"the store does not accept {msg.kind!r}")

    def _verify_rank(self, rank: int) -> None:
        for buffer in (0, 1):
            name = shm.segment_name(self.cfg.run_id, rank, buffer)
            seg = self._open(name)
            if seg is not None and seg.header().state == shm.STAGED:
                self._verify_staged(name)

    # -- persistence ------------------------------------------------------------------------
    def _maybe_persist(self) -> None:
        cfg = self.cfg
        if not cfg.persist_dir or self._committed <= 0:
            return
        due = False
        if cfg.persist_every > 0:
            last = self._persisted_step or 0
            due = self._committed // cfg.persist_every > last // cfg.persist_every
        if cfg.persist_interval_s > 0:
            due |= time.monotonic() - self._last_persist_mono >= cfg.persist_interval_s
        if due and self._committed != self._persisted_step:
            self.persist("schedule", wait=False)

    def persist(self, reason: str, wait: bool) -> None:
        """Write the newest committed step held here to disk (copy now, write in background)."""
        cfg = self.cfg
        if not cfg.persist_dir:
            return
        if self._pending_write is not None and not self._pending_write.done():
            if not wait:
                return  # the disk is behind; skip, the next one carries a newer step
            self._pending_write.result(timeout=600)
        step = self._committed
        shards = []
        for name in self._job_segments():
            seg = self._open(name)
            if seg is None:
                continue
            h = seg.header()
            if h.state != shm.VERIFIED or h.step != step or step <= 0:
                continue
            try:
                doc = parse_manifest(seg.manifest_bytes(h))
                shards.append((doc, bytes(seg.data(h)), seg.hashes(h)))
            except IntegrityError as e:
                log.error("not persisting %s: %s", name, e)
        if not shards:
            log.info("persist (%s): no committed step held here", reason)
            return
        self._last_persist_mono = time.monotonic()
        log.info("persisting step %d (%s): %d shard(s)", step, reason, len(shards))
        self._pending_write = self._writer.submit(self._write, step, shards)
        if wait:
            self._pending_write.result(timeout=600)

    def _write(self, step: int, shards: list[tuple[dict[str, Any], bytes, list[int]]]) -> None:
        from ftrun.snapshot import persist

        assert self.cfg.persist_dir
        root = Path(self.cfg.persist_dir)
        t0 = time.perf_counter()
        try:
            for doc, data, hashes in shards:
                persist.write_rank(root, doc, memoryview(data), hashes)
            if any(doc["rank"] == 0 for doc, _, _ in shards):
                persist.prune(root, self.cfg.persist_keep)
        except Exception:
            log.exception("persisting step %d failed", step)
            return
        self._persisted_step = step
        log.info("persisted step %d to %s in %.2f s", step, root, time.perf_counter() - t0)

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
        if self._job_segments():
            log.info("adopted %d segment(s) of job %s", len(self._job_segments()), self.cfg.run_id)

    def report(self) -> None:
        names = self._job_segments()
        total = 0
        ranks = set()
        for name in names:
            try:
                total += (shm.SHM_DIR / name).stat().st_size
                ranks.add(self._rank_of(name)[0])
            except (OSError, ValueError):
                continue
        if self._coord is not None:
            try:
                self._coord.request("store_report", {
                    "node_id": self.cfg.node_id, "bytes": total, "segments": len(names),
                    "persisted_step": self._persisted_step, "ranks": sorted(ranks),
                }, "ack", COORDINATOR_TIMEOUT_S)
            except (UnreachableError, FtrunError) as e:
                log.debug("store report: %s", e)

    def serve(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.cfg.url)
        self.adopt()
        log.info("snapshot store of job %s at %s", self.cfg.run_id, self.cfg.url)
        last_report = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if sock.poll(POLL_MS, zmq.POLLIN):
                        frames = sock.recv_multipart()
                        self._on_frames(sock, frames)
                    if self._persist_now.is_set():
                        self._persist_now.clear()
                        self.persist("SIGUSR1", wait=False)
                    if time.monotonic() - last_report >= REPORT_EVERY_S:
                        last_report = time.monotonic()
                        self._maybe_persist()
                        self.report()
                except Exception:  # noqa: BLE001 - the store must survive anything
                    log.exception("store loop error; continuing")
                    time.sleep(POLL_MS / 1000)
        finally:
            sock.close(0)
            self._shutdown()

    def _on_frames(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[1:]
        try:
            msg = protocol.decode(payload, secret=self._secret, job=self.cfg.run_id)
        except ProtocolError as e:
            log.warning("refused a message on %s: %s", self.cfg.url, e)
            return
        try:
            answer = self.handle(msg)
        except FtrunError as e:
            answer = ("error", {"message": str(e)[:4000], "error": type(e).__name__})
        if answer is not None:
            kind, body = answer
            sock.send_multipart([identity, *protocol.encode(
                kind, body, secret=self._secret, job=self.cfg.run_id, sender="store")])

    def stop(self, unlink: bool) -> None:
        self._unlink_at_exit = unlink
        self._stop.set()

    def _shutdown(self) -> None:
        if self._unlink_at_exit:
            try:
                self.persist("end of job", wait=True)
            except Exception:
                log.exception("final persist failed")
        self._writer.shutdown(wait=True)
        for name in list(self._segments):
            self._forget(name)
        if self._unlink_at_exit:
            for name in self._job_segments():
                try:
                    os.unlink(shm.SHM_DIR / name)
                except FileNotFoundError:
                    pass
            log.info("removed the job's snapshot segments")
        if self._coord is not None:
            self._coord.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftrun.snapshot.store")
    p.add_argument("--config", required=True, help="JSON StoreConfig")
    args = p.parse_args(argv)
    set_parent_death_signal(signal.SIGKILL)
    cfg = StoreConfig(**json.loads(args.config))
    if os.getppid() != cfg.owner_pid:
        return 1  # the launcher is already gone
    logging.basicConfig(level=knobs.LOG_LEVEL.get().upper(), stream=sys.stderr,
                        format="[ftrun-store %(asctime)s %(levelname)s] %(message)s",
                        datefmt="%H:%M:%S")
    secret = knobs.SECRET.get().encode() or jobs.load_secret(cfg.run_id, create=False)
    store = SnapshotStore(cfg, secret)
    signal.signal(signal.SIGTERM, lambda *_: store.stop(unlink=True))
    signal.signal(signal.SIGINT, lambda *_: store.stop(unlink=True))
    signal.signal(signal.SIGUSR1, lambda *_: store._persist_now.set())
    store.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
