"""``Snapshotter``: the few lines a training script adds to get per-step snapshots.

::

    snap = ftrun.Snapshotter(model, optimizer)      # after building (and wrapping) both
    start = snap.restore(extra={"epoch": 0})        # collective; 0 when there is nothing
    for step in range(start + 1, total + 1):
        ...forward, backward...
        optimizer.step()
        snap.save(step, extra={"epoch": epoch})     # returns at once; see below

What a snapshot holds: the model's and optimizer's state dicts as returned by
``torch.distributed.checkpoint.state_dict`` (so FSDP2/DTensor shards are this rank's local
shards, and DDP's ``module.`` prefix is gone), the RNG states (torch CPU, CUDA, numpy,
python ``random``), the ``extra`` tree you pass (data position, epoch, ...: tensors, numbers,
strings, lists, dicts), and the step.

When to call: ``save(step)`` right after ``optimizer.step()``; it captures the state of that
moment. The copy into shared memory runs in the background while the next forward and
backward run, and ``optimizer.step()`` waits for it (a pre-hook), so parameters are never
changed under it. If you change parameters in place elsewhere before the next
``optimizer.step()``, call ``snap.wait()`` first. ``restore()`` is collective: every rank
calls it, after ``init_process_group``; all return the same step, the newest one that every
rank holds complete and verified (memory first, then ``--persist-dir``).

Under plain ``torchrun`` or ``python`` (no ftrun store), both calls log once and do nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ftrun import _torch, knobs, protocol
from ftrun.errors import ConfigError, FtrunError, IntegrityError, UnreachableError
from ftrun.protocol.transport import Client
from ftrun.rank import shards
from ftrun.rank.cadence import Cadence, seconds
from ftrun.rank.rng import refresh_rng_state, rng_state, set_rng_state
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import flatten, manifest_blob, parse_manifest, tensor_view, unflatten
from ftrun.snapshot.verify import ChunkHasher

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 60.0
RNG_TIMEOUT_S = 600.0
CLAIM_ATTEMPT_S = 0.5
CLOSE_CLAIM_WAIT_S = 10.0  # close(): how long the last snapshot may wait for its buffer
RNG_KEY = "/rng/"
MODEL_KEY = "/model/"
SKIP_LOG_INTERVAL_S = 30.0
COPY_GROUP_BYTES = 64 << 20  # GPU: one event per group; its chunks are hashed once it lands
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
STORE_TIMEOUT_S = 5.0
STORE_HINT = ("is this node's snapshot store running? (the launcher starts it and restarts it "
              "when it dies; see the launcher's log)")


def _as_current(loaded: Any, current: Any) -> Any:
    """``loaded`` with every tensor that is a DTensor in ``current`` made one again.

    A snapshot holds a DTensor's local shard only; on the same world size the shard goes back
    with the live tensor's mesh, placements, shape and stride.
    """
    if isinstance(loaded, dict) and isinstance(current, dict):
        return {k: _as_current(v, current.get(k)) for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)) and isinstance(current, (list, tuple)) and \
            len(loaded) == len(current):
        return type(loaded)(_as_current(a, b) for a, b in zip(loaded, current, strict=True))
    if isinstance(loaded, torch.Tensor) and type(current).__name__ == "DTensor" and \
            type(loaded).__name__ != "DTensor":  # a resharded restore gives DTensors already
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(loaded.to(current.device), current.device_mesh,
                                  current.placements, shape=current.shape,
                                  stride=current.stride())
    return loaded


def _check_stateful(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``state=`` objects, checked: each follows torch's ``Stateful`` protocol."""
    if state is None:
        return {}
    if not isinstance(state, Mapping):
        raise ConfigError(f"state= takes a dict of name -> object, got {type(state).__qualname__}")
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"state= names must be non-empty strings, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"state[{name!r}] ({type(obj).__qualname__}) has no state_dict()/"
                "load_state_dict(): pass objects that follow torch's Stateful protocol (LR "
                "schedulers, StatefulDataLoader, GradScaler, ...), or put plain values in extra=")
    return dict(state)


class _SaveJob:
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


def _groups(entries: list[Any], limit: int, keep: Callable[[Any], bool]) -> list[list[int]]:
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


class Snapshotter:
    """Per-step in-memory snapshots of one rank's training state. See the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, state: Mapping[str, Any] | None = None, every: int | str | None = None,
                 async_copy: bool = True) -> None:
        self.cadence = Cadence(knobs.SNAPSHOT_EVERY.get() if every is None else every)
        self.model = model
        self.optimizer = optimizer
        self.stateful = _check_stateful(state)
        self._ddp_buckets: Any = None
        self._rng_due: dict[str, Any] | None = None  # the in-flight snapshot's RNG tensors
        self._rng_taken = threading.Event()
        self._copied = threading.Event()
        self._rng_restored: dict[str, Any] | None = None  # to apply at the next forward
        self._wait_s = seconds(knobs.SNAPSHOT_WAIT)
        self.extra: Any = None
        self.resumed_from: int = 0
        self.source = "none"  # where restore() found its step: "memory", "disk (...)", "none"
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.run_id = knobs.RUN_ID.get()
        self._secret = b""
        store_url = knobs.STORE.get()
        self.enabled = bool(store_url and self.run_id)
        self._async = async_copy
        self._segments: list[shm.Segment | None] = [None, None]
        self._newest: tuple[int, int] | None = None  # (buffer, step) of the newest good snapshot
        self._epoch = ""
        self._pending: _SaveJob | None = None
        self._last_save_call: float | None = None
        self._epoch_base = 0  # the step the current epoch resumed from
        self._unsaved: tuple[int, Any] | None = None  # (step, extra) of a save() not taken
        self._skip_logged = -SKIP_LOG_INTERVAL_S
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-snap")
        self._hasher = ThreadPoolExecutor(max_workers=HASH_THREADS,
                                          thread_name_prefix="ftrun-hash")
        self._copy_stream: Any = None
        self._registered: set[int] = set()
        self._lock = threading.Lock()
        self.committed = -1
        self.skipped_saves = 0
        if not self.enabled:
            log.warning("ftrun snapshots are off: not started by ftrun (no %s). Training runs "
                        "as usual; run it with `ftrun` to snapshot every step.",
                        knobs.STORE.name)
            self._chan = None
            return
        secret = self._secret = knobs.SECRET.get().encode()
        self._chan = Client(store_url, secret, self.run_id, f"rank:{self.rank}",
                            peer="snapshot store", hint=STORE_HINT,
                            on_reply=self._on_store_message)
        self._owner = int(os.environ.get("FTRUN_LAUNCHER_PID", os.getppid()))
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_optimizer_step)
        inner = getattr(model, "module", None)
        for module in (model, inner) if isinstance(inner, torch.nn.Module) else (model,):
            module.register_forward_pre_hook(self._on_forward)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The collective monitor (ftrun.rank.collectives), once per process.
            from ftrun.rank.collectives import monitor_collectives

            monitor_collectives()

    def _on_forward(self, *_: Any) -> None:
        """At the forward pass after a save() or restore(): the RNG states meet here.

        A snapshot records the RNG states that the forward pass after it starts with, and a
        restore re-applies them when the restored run's first forward pass starts. Whatever
        the script draws in between (a new DataLoader iterator draws a seed from the global
        generator; skipping batches may draw more) then cannot shift dropout and other
        random draws of the training step, in the uninterrupted run or the restored one.
        """
        if self._rng_restored is not None:
            set_rng_state(self._rng_restored)
            self._rng_restored = None
        self._take_rng()

    def _take_rng(self) -> None:
        due, self._rng_due = self._rng_due, None
        if due is not None:
            refresh_rng_state(due)
            self._rng_taken.set()

    # -- state ------------------------------------------------------------------------------
    def _state(self, step: int, extra: Any) -> dict[str, Any]:
        state = self._state_dicts()
        # Buffers change inside the next forward pass (batch-norm statistics, DDP's buffer
        # broadcast), which the background copy overlaps: take them now. They are small.
        buffers = {b.data_ptr() for b in self.model.buffers() if type(b) is torch.Tensor}
        state["model"] = {k: v.clone() if type(v) is torch.Tensor and v.data_ptr() in buffers
                          else v for k, v in state["model"].items()}
        state["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        state["rng"] = rng_state()
        layout = self._ddp_layout()
        if layout is not None:
            state["ddp_buckets"] = layout
        state["extra"] = extra
        state["step"] = step
        return state

    def _ddp_layout(self) -> Any:
        """DDP's rebuilt bucket layout (see ftrun._torch), once it is known."""
        if self._ddp_buckets is None:
            ddp = _torch.ddp_of(self.model)
            if ddp is not None:
                self._ddp_buckets = _torch.ddp_layout(ddp)
        return self._ddp_buckets

    def _apply(self, tree: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Snapshots hold each DTensor's local shard; give them back their placements.
        model_sd = _as_current(tree["model"], get_model_state_dict(self.model))
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=True))
        if self.optimizer is not None and "optim" in tree and \
                not _torch.load_optimizer_state(self.model, self.optimizer, tree["optim"]):
            # Sharded (DTensor) state: torch's own path, which first materialises the
            # optimizer's state with a throw-away step to learn the placements.
            current = get_optimizer_state_dict(self.model, self.optimizer)
            set_optimizer_state_dict(self.model, self.optimizer,
                                     _as_current(tree["optim"], current))
        saved = tree.get("stateful") or {}
        missing = sorted(set(self.stateful) - set(saved))
        if missing:
            raise ConfigError(
                f"the snapshot of step {tree['step']} holds no state for {', '.join(missing)} "
                f"(it holds: {', '.join(sorted(saved)) or 'none'}): pass the same state= names "
                "to Snapshotter as the run that wrote it, or start the job afresh")
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved[name])
        set_rng_state(tree["rng"])
        self._rng_restored = tree["rng"]
        ddp = _torch.ddp_of(self.model)
        layout = tree.get("ddp_buckets")
        # Reduce the next step with the buckets the uninterrupted run used.
        if ddp is not None and layout and not ddp._has_rebuilt_buckets and \
                _torch.ddp_use_layout(ddp, [list(b) for b in layout]):
            self._ddp_buckets = layout
        elif ddp is not None and not layout and _torch.ddp_will_rebuild(ddp):
            log.warning(
                "the snapshot of step %d carries no DDP bucket layout (it was written by an "
                "older ftrun, or before DDP's first backward): the next step reduces gradients "
                "in a different order than the uninterrupted run, so with 3 or more ranks the "
                "weights may differ in the last bits. Snapshots written from now on carry it; "
                "DistributedDataParallel(find_unused_parameters=True) avoids the rebuild "
                "altogether", tree["step"])
        self.extra = tree.get("extra")

    def _state_dicts(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return out

    # -- save -------------------------------------------------------------------------------
    def _before_optimizer_step(self, *_: Any) -> None:
        self.wait()
        self._unsaved = None  # the parameters change now: that step can no longer be taken

    def save(self, step: int, extra: Any = None) -> bool:
        """Snapshot the state after ``step``. Returns False when this call took no snapshot."""
        if not self.enabled:
            return False
        if not self._due(step):
            # close() takes it if training ends here (an interval that does not divide the
            # number of steps would otherwise leave the last steps out).
            self._unsaved = (step, extra) if self.optimizer is not None else None
            return False
        self._unsaved = None
        return self._snapshot(step, extra)

    def _snapshot(self, step: int, extra: Any) -> bool:
        if not self._epoch:
            # restore() was skipped: start counting commits without loading anything. Every
            # rank reaches its first save together, so this collective lines up.
            import torch.distributed as dist

            log.warning("save() before restore(): starting fresh (call restore() first to "
                        "resume after failures)")
            self._start_epoch(0, dist.is_available() and dist.is_initialized())
        self.wait()
        t0 = time.perf_counter()
        state = self._state(step, extra)
        # The RNG states go in as of the next forward pass (or wait()), not of now: that is
        # where a restored run picks up, whatever the script does in between (see _on_forward).
        self._rng_due = state["rng"]
        self._rng_taken.clear()
        self._copied.clear()
        flat = flatten(state)
        blob = manifest_blob(flat, step=step, rank=self.rank, world_size=self.world_size,
                             meta={"epoch": self._epoch, "time": time.time()})
        cuda = any(s.is_cuda for s in flat.sources)
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        if cuda:
            # The copy must see the values of this moment: order it after the work queued so far.
            self._copy_stream.wait_stream(torch.cuda.current_stream())
        # Buffers are sized (and /dev/shm checked) here, in the caller: a job that cannot
        # hold its snapshots fails at its first save with the fix in the message.
        self._ensure_segments(max(len(blob) * 2, 1 << 16), len(flat.tensors), flat.data_len)
        target = 0 if self._newest is None else 1 - self._newest[0]
        need = -1 if self._newest is None else self._newest[1]
        job = _SaveJob(step)
        job.future = self._pool.submit(self._write, job, target, need, flat, blob, cuda)
        self._pending = job
        if not self._async:
            self._copied.wait(timeout=600.0)
        log.debug("save(%d) returned after %.1f ms", step, (time.perf_counter() - t0) * 1e3)
        return True

    @property
    def every(self) -> int:
        """The current snapshot interval in steps (chosen online under ``every="auto"``)."""
        return self.cadence.k

    def _due(self, step: int) -> bool:
        now = time.perf_counter()
        if self._last_save_call is not None:
            self.cadence.observe(now - self._last_save_call)
        self._last_save_call = now
        if self.cadence.auto and step % Cadence.AGREE_EVERY == 0:
            self.cadence.agree(step)
        due = self.cadence.due(step)
        self.cadence.mark(due)
        return due

    def wait(self, timeout_s: float = 600.0, claim_wait_s: float | None = None) -> None:
        """Block until the snapshot in flight is copied (called before optimizer.step()).

        A snapshot whose buffer the store has not released yet (the step before it is not
        committed) is given up here and counted as skipped, and the step goes on: training
        never waits for the store (``FTRUN_SNAPSHOT_WAIT`` allows a wait, default 0).
        """
        self._take_rng()
        job, self._pending = self._pending, None
        if job is None or job.future is None:
            return
        # The buffer comes once the previous snapshot is committed: normally within
        # milliseconds. A store that is gone or stuck costs this snapshot, not the job.
        job.settled.wait(self._wait_s if claim_wait_s is None else claim_wait_s)
        if job.give_up():
            if job.count_skip():
                self._skipped(job.step, "the store had not released its buffer in time (the "
                              "previous snapshot was not committed yet)")
            return
        try:
            job.future.result(timeout=timeout_s)
        except FtrunError as e:
            log.error("snapshot failed: %s", e)

    def _skipped(self, step: int, why: str) -> None:
        self.skipped_saves += 1
        now = time.monotonic()
        if now - self._skip_logged >= SKIP_LOG_INTERVAL_S:
            self._skip_logged = now
            log.warning("skipped the snapshot of step %d: %s (%d skipped so far; training does "
                        "not wait for snapshots)", step, why, self.skipped_saves)

    def _claim(self, job: _SaveJob, target: int, need: int) -> int | None:
        """The buffer to write ``job`` into (``target``, or the newest one when its step can
        never commit), once the store grants it; None: give the snapshot up."""
        assert self._chan is not None
        if need < 0:
            return target if job.start() else None
        deadline = time.monotonic() + CLAIM_TIMEOUT_S
        delay = 0.001
        while not job.given_up:
            try:
                # Short attempts: a store killed and restarted by its launcher answers a
                # resent claim at once, instead of after one long timeout.
                reply = self._chan.request("snap_claim", {
                    "rank": self.rank, "buffer": target, "epoch": self._epoch,
                    "need_committed": need, "base": self._epoch_base}, "snap_claim_reply",
                    CLAIM_ATTEMPT_S,
                    attempts=int(3 * STORE_TIMEOUT_S / CLAIM_ATTEMPT_S))
            except UnreachableError as e:
                log.warning("store unreachable (%s); keeping older snapshot", e)
                return None
            self.committed = max(self.committed, reply.body["committed"])
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

    def _ensure_segments(self, manifest_cap: int, n_tensors: int, data_len: int) -> None:
        """Create (or grow) both buffers so they can hold a snapshot of this size."""
        stale = []
        for buffer, seg in enumerate(self._segments):
            if seg is None:
                stale.append(buffer)
                continue
            h = seg.header()
            if h.manifest_cap < manifest_cap or h.n_tensors != n_tensors \
                    or h.capacity - h.data_off < data_len \
                    or h.hash_slots < shm.chunk_count(data_len, h.chunk_size):
                stale.append(buffer)
        if not stale:
            return
        _, _, capacity = shm.layout_for(manifest_cap, data_len)
        shm.check_capacity(capacity * len(stale), f"rank {self.rank}'s snapshot buffers")
        self.wait()
        for buffer in stale:
            if self._newest is not None and self._newest[0] == buffer:
                # Growing the buffer that holds the newest snapshot would lose it: the state
                # grew (new optimizer state appears after its first step); start afresh.
                self._newest = None
            old = self._segments[buffer]
            if old is not None:
                ptr = torch.frombuffer(old.mm, dtype=torch.uint8).data_ptr()
                if ptr in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(ptr)
                    self._registered.discard(ptr)
                old.close()
            name = shm.segment_name(self.run_id, self.rank, buffer)
            self._segments[buffer] = shm.Segment.create(name, manifest_cap, n_tensors,
                                                        data_len, self._owner)

    def _write(self, job: _SaveJob, target: int, need: int, flat: Any, blob: bytes,
               cuda: bool) -> None:
        step = job.step
        try:
            claimed = self._claim(job, target, need)
        finally:
            job.settled.set()
        if claimed is None:
            self._copied.set()
            if job.count_skip():
                self._skipped(step, f"the store did not release a buffer (step {need} not "
                                    "committed, or the store unreachable)")
            return
        target = claimed
        seg = self._segments[target]
        assert seg is not None
        h = seg.set_state(shm.WRITING, step=step, epoch=self._epoch, data_len=flat.data_len,
                          hashes_xxh3=0)
        data = seg.data(h)
        # Each fixed-size chunk is hashed (on the hashing threads, which run without the GIL)
        # as soon as every tensor in it is copied, while the copy goes on: the hashes cover
        # exactly the bytes this rank wrote.
        hasher = ChunkHasher(data, [(e.offset, e.nbytes) for e in flat.tensors],
                             h.chunk_size, self._hasher)

        def copy(i: int, non_blocking: bool = False) -> None:
            entry = flat.tensors[i]
            tensor_view(data, entry).copy_(flat.sources[i].reshape(entry.shape),
                                           non_blocking=non_blocking)

        groups = _groups(flat.tensors, COPY_GROUP_BYTES, lambda e: not e.key.startswith(RNG_KEY))
        if cuda:
            # Device-to-host copies in groups on the side stream, into registered (pinned)
            # pages; each group is hashed once its event says it landed.
            self._register(seg)
            events = []
            with torch.cuda.stream(self._copy_stream):
                for group in groups:
                    for i in group:
                        copy(i, non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(self._copy_stream)
            for group, event in zip(groups, events, strict=True):
                event.synchronize()
                for i in group:
                    hasher.copied(i)
        else:
            for group in groups:
                for i in group:
                    copy(i)
                    hasher.copied(i)
        self._copied.set()
        if not self._rng_taken.wait(timeout=RNG_TIMEOUT_S):
            self._skipped(step, f"no forward pass and no wait() within {RNG_TIMEOUT_S:.0f} s "
                                "to take its RNG states")
            return
        late = [i for i, e in enumerate(flat.tensors) if e.key.startswith(RNG_KEY)]
        for i in late:
            copy(i)
            hasher.copied(i)
        hx = seg.write_hashes(hasher.finish())
        xh = seg.write_manifest(blob)
        seg.set_state(shm.STAGED, step=step, manifest_len=len(blob), manifest_xxh3=xh,
                      hashes_xxh3=hx, staged_at=time.time())
        self._newest = (target, step)
        assert self._chan is not None
        self._chan.send("snap_staged", {"rank": self.rank, "buffer": target, "step": step,
                                        "epoch": self._epoch, "skipped": self.skipped_saves,
                                        "every": self.cadence.k, "base": self._epoch_base})

    def _register(self, seg: shm.Segment) -> None:
        """Pin the segment's pages for the GPU so device-to-host copies are asynchronous DMA."""
        view = torch.frombuffer(seg.mm, dtype=torch.uint8)
        if view.data_ptr() in self._registered:
            return
        rc = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister failed (%s); copies will be synchronous", rc)
            return
        self._registered.add(view.data_ptr())

    def _on_store_message(self, msg: protocol.Message) -> None:
        if msg.kind == "snap_done":
            self.committed = max(self.committed, msg.body["committed"])
            if not msg.body["ok"]:
                log.error("the store could not verify step %d: %s", msg.body["step"],
                          msg.body.get("reason", "?"))

    # -- restore ----------------------------------------------------------------------------
    def restore(self, extra: Any = None) -> int:
        """Load the newest snapshot complete on every rank; returns its step (0: none).

        ``extra`` is what ``self.extra`` holds when nothing was restored.
        """
        self.extra = extra
        if not self.enabled:
            return 0
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        assert self._chan is not None
        try:
            self._chan.request("snap_flush", {"rank": self.rank}, "ack", STORE_TIMEOUT_S,
                               attempts=6)
        except UnreachableError as e:
            log.warning("snapshot store did not answer (%s); using what memory holds", e)
        local = self._local_steps()
        held = self._job_holdings(local)
        found = shards.complete(held)
        by_key = {c.key: c for c in found}
        if held and not found and self.rank == 0:
            log.warning("no step is held in full by the job's live stores: %s",
                        shards.describe_gaps(held))
        restored, source = 0, "none"
        for key in self._agree_candidates(list(by_key), distributed):
            cand = by_key[key]
            tree, how, own = self._load_candidate(cand, local)
            if self._all(tree is not None, distributed):
                assert tree is not None
                self._apply(tree)
                if own is not None:  # its own buffer holds the step: the next save keeps it
                    self._newest = (own, cand.step)
                restored, source = cand.step, how
                break
            log.warning("step %d (%d ranks) could not be loaded on some rank; trying an older "
                        "one", cand.step, cand.world_size)
        if restored == 0:
            restored, source = self._restore_persisted(distributed)
            if restored and self.rank == 0:
                log.warning("no step is complete and verified in the job's memory (%s); "
                            "restored step %d from %s", "none held in full by the live "
                            "stores" if not by_key else "none loaded", restored, source)
        self._start_epoch(restored, distributed, source)
        self.resumed_from = restored
        self.source = source
        return restored

    def _start_epoch(self, base_step: int, distributed: bool, source: str = "none") -> None:
        """Agree on a new epoch id and announce it; commits are counted per epoch."""
        assert self._chan is not None
        self._epoch = self._agree_epoch(distributed)
        self._epoch_base = base_step
        try:
            self._chan.request("snap_restored", {"rank": self.rank, "epoch": self._epoch,
                                                 "step": base_step,
                                                 "world_size": self.world_size,
                                                 "source": source},
                               "ack", STORE_TIMEOUT_S, attempts=3)
        except UnreachableError as e:
            log.warning("could not tell the store about the new epoch: %s", e)
        self.committed = base_step

    def _local_steps(self) -> dict[int, int]:
        """step -> buffer, for this rank's VERIFIED shards, as its node's store lists them
        (the store owns the segments: it says which are this rank's, and in what state)."""
        assert self._chan is not None
        try:
            reply = self._chan.request("catalog_request", {"rank": self.rank}, "catalog_reply",
                                       STORE_TIMEOUT_S, attempts=3)
        except (UnreachableError, FtrunError) as e:
            log.warning("the snapshot store did not list this rank's snapshots (%s); memory "
                        "is not used for this restore", e)
            return {}
        out: dict[int, int] = {}
        for rec in reply.body["records"]:
            buffer, name = int(rec["buffer"]), str(rec["segment"])
            if rec["rank"] != self.rank or buffer not in (0, 1):
                continue
            try:
                seg = shm.Segment.open(name)
            except FileNotFoundError:
                continue
            except (IntegrityError, OSError, ValueError) as e:
                log.warning("ignoring segment %s: %s", name, e)
                continue
            self._segments[buffer] = seg
            h = seg.header()
            if h.state == shm.VERIFIED:
                out[h.step] = buffer
            elif h.state in (shm.WRITING, shm.STAGED):
                log.warning("buffer %d holds step %d %s: torn or unverified, not loaded",
                            buffer, h.step, h.state_name)
        return out

    def _job_holdings(self, local: dict[int, int]) -> list[shards.Holding]:
        """Every verified shard the job's live stores hold (this node's included), as their
        shard services list them; this rank's own buffers at least."""
        node = knobs.NODE_ID.get()
        stores: dict[str, str] = {}
        assert self._chan is not None
        try:
            reply = self._chan.request("stores_request", {}, "stores_reply", STORE_TIMEOUT_S,
                                       attempts=2)
            stores = {s["node_id"]: s["addr"] for s in reply.body["stores"]}
        except (UnreachableError, FtrunError) as e:
            log.warning("the snapshot store did not list the job's stores (%s); only this "
                        "rank's own snapshots are used", e)
        held, lost = shards.survey(stores, self._secret, self.run_id, f"rank:{self.rank}")
        if lost:
            log.warning("rank %d: the store(s) of %s did not answer; their shards are read "
                        "from replicas, where there are any", self.rank, ", ".join(lost))
        seen = {(h.node, h.segment) for h in held}
        for step, buffer in local.items():  # this rank's own, should its store not list them
            seg = self._segments[buffer]
            if seg is None or (node, seg.name) in seen:
                continue
            try:
                h = seg.header()
                world = int(parse_manifest(seg.manifest_bytes(h))["world_size"])
            except (FtrunError, KeyError, TypeError, ValueError):
                continue  # _load_memory refuses it with its reason
            held.append(shards.Holding(node, "", seg.name, node, self.rank, step, h.epoch,
                                       world, h.data_len, h.chunk_size))
        return held

    def _agree_candidates(self, mine: list[tuple[int, str, int]],
                          distributed: bool) -> list[tuple[int, str, int]]:
        """The (step, epoch, world size) every rank found complete, newest first."""
        if not distributed:
            return sorted(mine, key=lambda k: (-k[0], k[1], k[2]))
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        common = set(mine)
        for theirs in everyone:
            common &= set(theirs or [])
        return sorted(common, key=lambda k: (-k[0], k[1], k[2]))

    def _load_candidate(self, cand: shards.Candidate, local: dict[int, int]) -> tuple[
            dict[str, Any] | None, str, int | None]:
        """This rank's state from a step held in full across the job: (tree or None, where
        from, its own buffer when that is what was loaded). Its own buffer when it holds it;
        else the shard of the same rank from whichever node holds it; else, taken by another
        number of ranks, resharded from theirs."""
        from ftrun.rank import memload

        node = knobs.NODE_ID.get()
        buffer = local.get(cand.step)
        seg = self._segments[buffer] if buffer is not None else None
        if cand.world_size == self.world_size and seg is not None:
            try:
                own = seg.header().epoch == cand.epoch
            except IntegrityError:
                own = False
            if own:
                tree = self._load_memory(buffer, cand.step)  # type: ignore[arg-type]
                if tree is not None:
                    return tree, "memory", buffer
        old_ranks = [self.rank] if cand.world_size == self.world_size else list(cand.holders)
        readers = {old: shards.ShardReader(cand.holders[old], node, self._secret, self.run_id,
                                           f"rank:{self.rank}") for old in old_ranks}
        try:
            if cand.world_size == self.world_size:
                tree = memload.load_whole(readers[self.rank])
                how = "memory"
            else:
                tree, nbytes = memload.reshard(readers, rank=self.rank,
                                               world_size=self.world_size,
                                               live_state=self._state_dicts)
                how = f"memory, resharded from {cand.world_size} ranks"
                log.info("rank %d: read %.1f MB of step %d's %d-rank snapshot to reshard it",
                         self.rank, nbytes / 1e6, cand.step, cand.world_size)
        except Exception as e:  # noqa: BLE001 - any failure: the ranks try an older step
            log.error("rank %d: step %d (%d ranks) held in memory could not be loaded: %s",
                      self.rank, cand.step, cand.world_size, e)
            return None, "", None
        finally:
            for r in readers.values():
                r.close()
        sources = sorted({n for r in readers.values() for n in r.sources})
        if sources and sources != [node]:
            how += f" (from node(s) {', '.join(sources)})"
        return tree, how, None

    def _all(self, ok: bool, distributed: bool) -> bool:
        if not distributed:
            return ok
        import torch.distributed as dist

        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(ok))
        return all(flags)

    def _agree_epoch(self, distributed: bool) -> str:
        epoch = [uuid.uuid4().hex[:16]]
        if distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(epoch, src=0)
        return epoch[0]

    def _load_memory(self, buffer: int, step: int) -> dict[str, Any] | None:
        seg = self._segments[buffer]
        if seg is None:
            return None
        ok, reason = verify.check(seg, self._hasher)
        if not ok:
            log.error("rank %d: snapshot of step %d in buffer %d is not loadable (%s); it will "
                      "not be used", self.rank, step, buffer, reason)
            return None
        h = seg.header()
        doc = parse_manifest(seg.manifest_bytes(h))
        if doc["world_size"] != self.world_size or doc["step"] != step:
            return None
        data = seg.data(h)
        # The model's tensors are copied into its parameters and buffers by
        # set_model_state_dict: views into the buffer are enough (no clone of them, whose
        # fresh pages would cost more than the copy). Everything else is cloned: the optimizer
        # and Stateful objects keep what they are given, and must not alias the buffer.
        return unflatten(doc, lambda _i, entry: tensor_view(data, entry)
                         if entry.key.startswith(MODEL_KEY) else tensor_view(data, entry).clone())

    def _restore_persisted(self, distributed: bool) -> tuple[int, str]:
        """The newest persisted step that is complete and verifies on every rank (collective;
        ftrun.rank.fallback). Raises RestoreError when steps exist but none is usable."""
        root = knobs.PERSIST_DIR.get()
        if not root:
            return 0, "none"
        from ftrun.errors import RestoreError
        from ftrun.rank.fallback import gather_all, record_for_launcher, restore_from_disk

        try:
            found = restore_from_disk(root, rank=self.rank, world_size=self.world_size,
                                      gather=gather_all(distributed),
                                      live_state=self._state_dicts)
        except RestoreError as e:
            record_for_launcher(e)
            raise
        if found.step == 0:
            return 0, "none"
        self._apply(found.tree)
        return found.step, f"disk ({root})"

    def close(self) -> None:
        """Take the last step if the interval skipped it, wait for the copy, release buffers.

        Every rank calls it after training (the last snapshot is committed across ranks).
        """
        if self.enabled and self._unsaved is not None:
            step, extra = self._unsaved
            self._unsaved = None
            log.debug("close(): taking step %d, which the snapshot interval skipped", step)
            self._snapshot(step, extra)
        # Training is over: nothing changes the state under the copy any more, so the last
        # snapshot may wait a little for its buffer (the others' copies of the step before).
        self.wait(claim_wait_s=max(self._wait_s, CLOSE_CLAIM_WAIT_S))
        self._pool.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        for ptr in self._registered:  # unpin before the mappings go away
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        for seg in self._segments:
            if seg is not None:
                seg.close()
        if self._chan is not None:
            self._chan.close()
