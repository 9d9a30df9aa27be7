"""A rank's save: claim a buffer from the store, copy the state into it while hashing each
chunk (in the background, overlapping the next forward and backward), mark it staged and
tell the store. Training never waits for the store: a buffer not granted in time costs
that snapshot, counted as skipped."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

import torch

from ftrun.errors import FtrunError, UnreachableError
from ftrun.rank import replicas
from ftrun.rank.cadence import Cadence
from ftrun.rank.context import STORE_TIMEOUT_S, RankContext
from ftrun.rank.rng import refresh_rng_state
from ftrun.rank.state import TrainingState
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import flatten, manifest_blob, tensor_view
from ftrun.snapshot.replicas import place, seal
from ftrun.snapshot.verify import ChunkHasher

log = logging.getLogger("ftrun.rank.snapshotter")

CLAIM_TIMEOUT_S = 60.0
RNG_TIMEOUT_S = 600.0
CLAIM_ATTEMPT_S = 0.5
RNG_KEY = "/rng/"
SKIP_LOG_INTERVAL_S = 30.0
CLOSE_JOIN_S = 60.0  # close(): the copy was waited for already; this bounds a stuck device copy
ABANDON_JOIN_S = 2.0  # abandon(): the copy thread's waits are released; one chunk's copy at most
COPY_GROUP_BYTES = 64 << 20  # GPU: one event per group; its chunks are hashed once it lands

# Fault injection (ftrun.faults.kill_in_snapshot_copy installs it): called from the copy
# thread with the step once the first group of a snapshot's tensors is copied.
copy_fault: Callable[[int], None] | None = None


class CopyThread:
    """One daemon thread that runs the snapshot copies in order.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so a rank whose
    script raised would wait there for a copy still waiting for its RNG states (the next
    forward pass, which never comes). A rank that is leaving never waits for this thread;
    :meth:`Saver.abandon` releases its waits first.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] \
            = SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)

    def shutdown(self, timeout_s: float) -> bool:
        """Stop once the queued copies ran; False when the thread is still busy after
        ``timeout_s`` (it is a daemon: it never holds the process)."""
        if self._thread is None:
            return True
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class SaveJob:
    """One save() in flight: the copy thread starts it, or wait() gives it up first."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.future: Future[None] | None = None
        self.given_up = False
        self.started = threading.Event()
        self.settled = threading.Event()  # started, or the copy thread gave up
        self._counted = False
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Copy thread, once its buffer is granted: False if wait() gave the save up."""
        with self._lock:
            if not self.given_up:
                self.started.set()
            self.settled.set()
            return not self.given_up

    def give_up(self) -> bool:
        """Training thread: True if the copy had not started (and now never will)."""
        with self._lock:
            self.given_up = not self.started.is_set()
            return self.given_up

    def count_skip(self) -> bool:
        """True for the first of the two threads to count this save as skipped."""
        with self._lock:
            first, self._counted = not self._counted, True
            return first


def copy_groups(entries: list[Any], limit: int, keep: Callable[[Any], bool]) -> list[list[int]]:
    """Indices of the kept ``entries``, in order, in groups of about ``limit`` bytes."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, e in enumerate(entries):
        if not keep(e):
            continue
        if groups[-1] and size + e.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += e.nbytes
    return [g for g in groups if g]


class Saver:
    """Takes one rank's snapshots into its two buffers, one in flight at a time."""

    def __init__(self, ctx: RankContext, state: TrainingState, cadence: Cadence,
                 async_copy: bool, wait_s: float) -> None:
        self._ctx = ctx
        self._state = state
        self.cadence = cadence
        self._async = async_copy
        self._wait_s = wait_s
        self._rng_due: dict[str, Any] | None = None  # the in-flight snapshot's RNG tensors
        self._rng_taken = threading.Event()  # set by take_rng(), or by abandon() (leaving)
        self._leaving = threading.Event()  # abandon(): every wait of the copy thread ends
        self._copied = threading.Event()
        self._pending: SaveJob | None = None
        self._latest: SaveJob | None = None  # the newest job submitted (wait() keeps it)
        self._skip_logged = -SKIP_LOG_INTERVAL_S
        self._pool = CopyThread("ftrun-snap")
        self._copy_stream: Any = None
        self._registered: set[int] = set()
        self.skipped_saves = 0
        self.taken_saves = 0  # snapshots begun (each is then staged or skipped)
        self.blocked_s = 0.0  # time the training thread spent in snapshot() and wait()
        # Whose running totals the staged messages carry: the store adds up a rank's totals
        # over its Snapshotters (a restarted rank starts from zero) by this identity.
        self.counts_id = os.urandom(4).hex()
        self.skip_reasons: Counter[str] = Counter()  # skipped snapshots by reason
        self._skipped_unlogged = 0  # skipped since the last warning line

    def take_rng(self) -> None:
        due, self._rng_due = self._rng_due, None
        if due is not None:
            refresh_rng_state(due)
            self._rng_taken.set()

    def snapshot(self, step: int, extra: Any) -> bool:
        if not self._ctx.epoch:
            # restore() was skipped: start counting commits without loading anything. Every
            # rank reaches its first save together, so this collective lines up.
            import torch.distributed as dist

            log.warning("save() before restore(): starting fresh (call restore() first to "
                        "resume after failures)")
            self._ctx.start_epoch(0, dist.is_available() and dist.is_initialized())
        self.wait()
        self.taken_saves += 1
        t0 = time.perf_counter()
        try:
            return self._snapshot(step, extra, t0)
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _snapshot(self, step: int, extra: Any, t0: float) -> bool:
        state = self._state.capture(step, extra)
        # The RNG states go in as of the next forward pass (or wait()), not of now: that is
        # where a restored run picks up, whatever the script does in between (see _on_forward).
        self._rng_due = state["rng"]
        self._rng_taken.clear()
        self._copied.clear()
        flat = flatten(state)
        # Tensors equal on other ranks (DDP replicas) go first, in chunk-aligned blocks: their
        # chunk hashes are compared across replicas (silent corruption; ftrun.snapshot.replicas).
        flat, blocks, gaps = place(flat, replicas.groups(state, self._state.model,
                                                         self._state.optimizer, flat),
                                   shm.CHUNK_BYTES)
        ctx = self._ctx
        meta: dict[str, Any] = {"epoch": ctx.epoch, "time": time.time()}
        if blocks:
            meta["replicas"] = blocks
        blob = manifest_blob(flat, step=step, rank=ctx.rank, world_size=ctx.world_size,
                             meta=meta)

        def manifest(data: memoryview) -> bytes:
            """The manifest, with the blocks' tail hashes once the data is copied."""
            if not blocks:
                return blob
            seal(blocks, data)
            return manifest_blob(flat, step=step, rank=ctx.rank, world_size=ctx.world_size,
                                 meta=meta)
        cuda = any(s.is_cuda for s in flat.sources)
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        if cuda:
            # The copy must see the values of this moment: order it after the work queued so far.
            self._copy_stream.wait_stream(torch.cuda.current_stream())
        # Buffers are sized (and /dev/shm checked) here, in the caller: a job that cannot
        # hold its snapshots fails at its first save with the fix in the message.
        self.ensure_segments(len(blob), len(flat.tensors), flat.data_len)
        target = 0 if self._ctx.newest is None else 1 - self._ctx.newest[0]
        need = -1 if self._ctx.newest is None else self._ctx.newest[1]
        job = SaveJob(step)
        job.future = self._pool.submit(self.write, job, target, need, flat, manifest, cuda,
                                       gaps)
        self._pending = self._latest = job
        if not self._async:
            self._copied.wait(timeout=600.0)
        log.debug("save(%d) returned after %.1f ms", step, (time.perf_counter() - t0) * 1e3)
        return True

    def wait(self, timeout_s: float = 600.0, claim_wait_s: float | None = None) -> None:
        """Block until the snapshot in flight is copied; see ``Snapshotter.wait``."""
        t0 = time.perf_counter()
        try:
            self._wait(timeout_s, claim_wait_s)
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _wait(self, timeout_s: float, claim_wait_s: float | None) -> None:
        self.take_rng()
        job, self._pending = self._pending, None
        if job is None or job.future is None:
            return
        # The buffer comes once the previous snapshot is committed: normally within
        # milliseconds. A store that is gone or stuck costs this snapshot, not the job.
        job.settled.wait(self._wait_s if claim_wait_s is None else claim_wait_s)
        if job.give_up():
            if job.count_skip():
                self.skipped(job.step, "the store had not released its buffer in time (the "
                             "previous snapshot was not committed yet)", "store_busy")
            return
        try:
            job.future.result(timeout=timeout_s)
        except FtrunError as e:
            log.error("snapshot failed: %s", e)

    def skipped(self, step: int, why: str, reason: str) -> None:
        """Count a skipped snapshot under ``reason`` (a short key: ``store_busy``,
        ``no_buffer``, ``no_forward``) and say so at most once per SKIP_LOG_INTERVAL_S, with how
        many were skipped since the last line and in all."""
        self.skipped_saves += 1
        self.skip_reasons[reason] += 1
        self._skipped_unlogged += 1
        self.cadence.skipped()
        now = time.monotonic()
        if now - self._skip_logged >= SKIP_LOG_INTERVAL_S:
            self._skip_logged = now
            since, self._skipped_unlogged = self._skipped_unlogged, 0
            log.warning("skipped the snapshot of step %d: %s (%d skipped since the last such "
                        "line; %d of %d in all; training does not wait for snapshots)", step,
                        why, since, self.skipped_saves, self.taken_saves)

    def summary(self) -> str:
        """How many snapshots were taken and skipped, and why: for the closing log line."""
        reasons = ", ".join(f"{n} {why}" for why, n in self.skip_reasons.most_common())
        return (f"{self.taken_saves - self.skipped_saves} of {self.taken_saves} snapshots "
                f"staged, {self.skipped_saves} skipped" + (f" ({reasons})" if reasons else ""))

    def claim(self, job: SaveJob, target: int, need: int) -> int | None:
        """The buffer to write ``job`` into (``target``, or the newest one when its step can
        never commit), once the store grants it; None: give the snapshot up."""
        assert self._ctx.chan is not None
        if need < 0:
            return target if job.start() else None
        deadline = time.monotonic() + CLAIM_TIMEOUT_S
        delay = 0.001
        silent_since: float | None = None
        while not job.given_up and not self._leaving.is_set():
            try:
                # Short attempts, one per request: a store killed and restarted by its
                # launcher answers a resent claim at once, and a save given up meanwhile
                # (the training thread moved on) ends this loop within one attempt, so the
                # copy thread is free for the next save and for an in-process restart.
                reply = self._ctx.chan.request("snap_claim", {
                    "rank": self._ctx.rank, "buffer": target, "epoch": self._ctx.epoch,
                    "need_committed": need, "base": self._ctx.epoch_base}, "snap_claim_reply",
                    CLAIM_ATTEMPT_S)
            except UnreachableError as e:
                now = time.monotonic()
                silent_since = now if silent_since is None else silent_since
                if now - silent_since >= 3 * STORE_TIMEOUT_S:
                    log.warning("store unreachable for %.0f s (%s); keeping older snapshot",
                                now - silent_since, e)
                    return None
                continue
            silent_since = None
            self._ctx.committed = max(self._ctx.committed, reply.body["committed"])
            if reply.body["ok"]:
                buffer = reply.body.get("buffer", target)
                if buffer != target:
                    log.debug("step %d can never commit (a rank skipped it): step %d "
                              "overwrites it", need, job.step)
                return buffer if job.start() else None
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return None

    def ensure_segments(self, manifest_len: int, n_tensors: int, data_len: int) -> None:
        """Create (or grow) both buffers so they can hold a snapshot of this size. The
        manifest slot gets twice the room it needs: a manifest that grows a little with each
        step (a framework's log history in ``extra``) keeps its buffers, and the rank its
        newest snapshot, until it has doubled."""
        stale = []
        for buffer, seg in enumerate(self._ctx.segments):
            if seg is None:
                stale.append(buffer)
                continue
            h = seg.header()
            if h.manifest_cap < manifest_len or h.n_tensors != n_tensors \
                    or h.capacity - h.data_off < data_len \
                    or h.hash_slots < shm.chunk_count(data_len, h.chunk_size):
                stale.append(buffer)
        if not stale:
            return
        manifest_cap = max(2 * manifest_len, 1 << 16)
        _, _, capacity = shm.layout_for(manifest_cap, data_len)
        shm.check_capacity(capacity * len(stale), f"rank {self._ctx.rank}'s snapshot buffers")
        self.wait()
        for buffer in stale:
            if self._ctx.newest is not None and self._ctx.newest[0] == buffer:
                # Growing the buffer that holds the newest snapshot would lose it: the state
                # grew (new optimizer state appears after its first step); start afresh.
                self._ctx.newest = None
            old = self._ctx.segments[buffer]
            if old is not None:
                ptr = torch.frombuffer(old.mm, dtype=torch.uint8).data_ptr()
                if ptr in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(ptr)
                    self._registered.discard(ptr)
                old.close()
            name = shm.segment_name(self._ctx.run_id, self._ctx.rank, buffer)
            self._ctx.segments[buffer] = shm.Segment.create(name, manifest_cap, n_tensors,
                                                            data_len, self._ctx.owner)

    def write(self, job: SaveJob, target: int, need: int, flat: Any,
              manifest: Callable[[memoryview], bytes], cuda: bool,
              gaps: list[tuple[int, int]]) -> None:
        step = job.step
        try:
            claimed = self.claim(job, target, need)
        finally:
            job.settled.set()
        if claimed is None:
            self._copied.set()
            if job.count_skip():
                self.skipped(step, f"the store did not release a buffer (step {need} not "
                                   "committed, or the store unreachable)", "no_buffer")
            return
        target = claimed
        seg = self._ctx.segments[target]
        assert seg is not None
        h = seg.set_state(shm.WRITING, step=step, epoch=self._ctx.epoch, data_len=flat.data_len,
                          hashes_xxh3=0)
        data = seg.data(h)
        for lo, hi in gaps:  # between replicated tensors, hashed with them: zero everywhere
            data[lo:hi] = bytes(hi - lo)
        # Each fixed-size chunk is hashed (on the hashing threads, which run without the GIL)
        # as soon as every tensor in it is copied, while the copy goes on: the hashes cover
        # exactly the bytes this rank wrote.
        hasher = ChunkHasher(data, [(e.offset, e.nbytes) for e in flat.tensors],
                             h.chunk_size, self._ctx.hasher)

        def copy(i: int, non_blocking: bool = False) -> None:
            entry = flat.tensors[i]
            tensor_view(data, entry).copy_(flat.sources[i].reshape(entry.shape),
                                           non_blocking=non_blocking)

        groups = copy_groups(flat.tensors, COPY_GROUP_BYTES,
                             lambda e: not e.key.startswith(RNG_KEY))
        if cuda:
            # Device-to-host copies in groups on the side stream, into registered (pinned)
            # pages; each group is hashed once its event says it landed.
            self.register(seg)
            events = []
            with torch.cuda.stream(self._copy_stream):
                for group in groups:
                    for i in group:
                        copy(i, non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(self._copy_stream)
            for group, event in zip(groups, events, strict=True):
                event.synchronize()
                if self._leaving.is_set():
                    return
                for i in group:
                    hasher.copied(i)
                if copy_fault is not None:
                    copy_fault(step)
        else:
            for group in groups:
                if self._leaving.is_set():
                    return
                for i in group:
                    copy(i)
                    hasher.copied(i)
                if copy_fault is not None:
                    copy_fault(step)
        self._copied.set()
        if not self._rng_taken.wait(timeout=RNG_TIMEOUT_S):
            self.skipped(step, f"no forward pass and no wait() within {RNG_TIMEOUT_S:.0f} s "
                               "to take its RNG states", "no_forward")
            return
        if self._leaving.is_set():
            return  # the rank is leaving (an exception, an abort, the interpreter's exit)
        late = [i for i, e in enumerate(flat.tensors) if e.key.startswith(RNG_KEY)]
        for i in late:
            copy(i)
            hasher.copied(i)
        hx = seg.write_hashes(hasher.finish())
        blob = manifest(data)
        xh = seg.write_manifest(blob)
        seg.set_state(shm.STAGED, step=step, manifest_len=len(blob), manifest_xxh3=xh,
                      hashes_xxh3=hx, staged_at=time.time())
        self._ctx.newest = (target, step)
        assert self._ctx.chan is not None
        self._ctx.chan.send("snap_staged", {
            "rank": self._ctx.rank, "buffer": target, "step": step, "epoch": self._ctx.epoch,
            "skipped": self.skipped_saves, "every": self.cadence.k,
            "base": self._ctx.epoch_base, "blocked_s": round(self.blocked_s, 4),
            "skip_reasons": dict(self.skip_reasons), "counts": self.counts_id})

    def register(self, seg: shm.Segment) -> None:
        """Pin the segment's pages for the GPU so device-to-host copies are asynchronous DMA."""
        view = torch.frombuffer(seg.mm, dtype=torch.uint8)
        if view.data_ptr() in self._registered:
            return
        rc = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister failed (%s); copies will be synchronous", rc)
            return
        self._registered.add(view.data_ptr())

    def abandon(self) -> None:
        """The rank is leaving (the training function raised or was aborted, or the
        interpreter exits): every wait of the copy thread ends now (a snapshot still waiting
        for its buffer or for its RNG states is dropped, never staged), then :meth:`close`."""
        self._leaving.set()
        self._rng_taken.set()
        self._copied.set()
        job = self._latest
        if job is not None:
            job.give_up()
        self.close(ABANDON_JOIN_S)

    def close(self, timeout_s: float = CLOSE_JOIN_S) -> None:
        """Stop the copy thread and unpin the buffers' pages (before their mappings go)."""
        if not self._pool.shutdown(timeout_s):
            log.warning("the snapshot copy thread is still busy after %.1f s; leaving it (its "
                        "snapshot is not staged)", timeout_s)
            self._leaving.set()
            return  # its pages stay pinned and mapped: it may still be writing into them
        self._ctx.hasher.shutdown(wait=True)
        for ptr in self._registered:  # unpin before the mappings go away
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
