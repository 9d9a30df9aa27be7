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

import atexit
import logging
import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ftrun import knobs
from ftrun.rank.cadence import Cadence, seconds
from ftrun.rank.context import RankContext
from ftrun.rank.restore import Restorer
from ftrun.rank.rng import set_rng_state
from ftrun.rank.save import Saver
from ftrun.rank.state import TrainingState

__all__ = ["Cadence", "Snapshotter"]

log = logging.getLogger(__name__)

CLOSE_CLAIM_WAIT_S = 10.0  # close(): how long the last snapshot may wait for its buffer

_OPEN: weakref.WeakSet[Snapshotter] = weakref.WeakSet()  # not closed yet: abandon_all()
_SAID_OFF = False  # "snapshots are off" was logged (or is rank 0's to log)


def abandon_all() -> None:
    """Release every Snapshotter of this process that was not closed: the training function
    was aborted for an in-process restart and the next run builds its own. The copy thread
    stops, pinned pages are unpinned before their mappings go (a later registration of the
    same addresses would fail), buffers and the store channel close; no snapshot is taken."""
    for snap in list(_OPEN):
        try:
            snap._release(abandon=True)
        except Exception as e:  # noqa: BLE001 - never in the way of a restart
            log.warning("could not release a snapshotter: %s: %s", type(e).__name__, e)


# The interpreter's exit (a script that raised, or ended without close()) releases the copy
# threads' waits and unpins their buffers: no thread of ftrun's holds a rank that is leaving.
atexit.register(abandon_all)


class Snapshotter:
    """Per-step in-memory snapshots of one rank's training state. See the module docstring.

    The façade over the rank's parts: ``TrainingState`` (capture and apply), ``Saver``
    (claim, copy, stage), ``Restorer`` (find, load, verify, reshard, fall back to disk) and
    the ``RankContext`` they share (identity, store channel, buffers, epoch).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, state: Mapping[str, Any] | None = None, every: int | str | None = None,
                 async_copy: bool = True, forward_hooks: bool = True,
                 optimizer_hook: bool = True) -> None:
        self.cadence = Cadence(knobs.SNAPSHOT_EVERY.get() if every is None else every)
        self.model = model
        self.optimizer = optimizer
        self._training = TrainingState(model, optimizer, state)
        self.stateful = self._training.stateful
        self._wait_s = seconds(knobs.SNAPSHOT_WAIT)
        self.resumed_from: int = 0
        self.source = "none"  # where restore() found its step: "memory", "disk (...)", "none"
        self._ctx = ctx = RankContext()
        self.rank, self.world_size, self.run_id = ctx.rank, ctx.world_size, ctx.run_id
        self.enabled = ctx.enabled
        self._last_save_call: float | None = None
        self._blocked_mark = 0.0  # the saver's blocked time at the last save() call
        self._unsaved: tuple[int, Any] | None = None  # (step, extra) of a save() not taken
        self._saver = Saver(ctx, self._training, self.cadence, async_copy, self._wait_s)
        self._restorer = Restorer(ctx, self._training)
        _OPEN.add(self)
        if not self.enabled:
            global _SAID_OFF
            # Once per job, as the docs say: by rank 0 (RANK under torchrun), once per process.
            if not _SAID_OFF and os.environ.get("RANK", "0") == "0":
                log.warning("ftrun snapshots are off: not started by ftrun (no %s). Training "
                            "runs as usual; run it with `ftrun` to snapshot every step.",
                            knobs.STORE.name)
            _SAID_OFF = True
            return
        ctx.connect()
        if optimizer is not None and optimizer_hook:  # False: before_optimizer_step() is called
            optimizer.register_step_pre_hook(self._before_optimizer_step)
        if forward_hooks:  # False: the caller calls step_begins()
            inner = getattr(model, "module", None)
            for module in (model, inner) if isinstance(inner, torch.nn.Module) else (model,):
                module.register_forward_pre_hook(self._on_forward)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The collective monitor (ftrun.rank.collectives), once per process.
            from ftrun.rank.collectives import monitor_collectives

            monitor_collectives()

    @property
    def extra(self) -> Any:
        """The ``extra`` tree of the restored snapshot (or what ``restore(extra=)`` was given)."""
        return self._training.extra

    @extra.setter
    def extra(self, value: Any) -> None:
        self._training.extra = value

    @property
    def committed(self) -> int:
        """The newest step this rank knows committed."""
        return self._ctx.committed

    @property
    def skipped_saves(self) -> int:
        """Snapshots given up so far (training never waits for the store)."""
        return self._saver.skipped_saves

    def step_begins(self) -> None:
        """Mark the start of a training step, for ``Snapshotter(forward_hooks=False)``.

        A framework whose model runs forward passes outside training steps (validation)
        calls this right before each training step instead (``ftrun.integrations``).
        """
        self._on_forward()

    def _on_forward(self, *_: Any) -> None:
        """At the forward pass after a save() or restore(): the RNG states meet here.

        A snapshot records the RNG states that the forward pass after it starts with, and a
        restore re-applies them when the restored run's first forward pass starts. Whatever
        the script draws in between (a new DataLoader iterator draws a seed from the global
        generator; skipping batches may draw more) then cannot shift dropout and other
        random draws of the training step, in the uninterrupted run or the restored one.
        """
        if self._training.rng_restored is not None:
            set_rng_state(self._training.rng_restored)
            self._training.rng_restored = None
        self._saver.take_rng()

    def before_optimizer_step(self) -> None:
        """Wait for the copy in flight: the parameters are about to change. Registered as the
        optimizer's step pre-hook unless ``Snapshotter(optimizer_hook=False)``.

        A framework whose ``optimizer.step(closure)`` runs the forward and backward inside the
        step (Lightning) calls this itself, after the closure and right before the update,
        so the copy overlaps the forward and backward instead of holding them up.
        """
        self.wait()
        self._unsaved = None  # the parameters change now: that step can no longer be taken

    def _before_optimizer_step(self, *_: Any) -> None:
        self.before_optimizer_step()

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
        return self._saver.snapshot(step, extra)

    @property
    def every(self) -> int:
        """The current snapshot interval in steps (chosen online under ``every="auto"``)."""
        return self.cadence.k

    def _due(self, step: int) -> bool:
        now = time.perf_counter()
        if self._last_save_call is not None:
            self.cadence.observe(now - self._last_save_call)
            if self.cadence.auto and self.cadence.last_due:
                # What the step that took a snapshot spent in save() and wait(): the least it
                # cost training, whatever the step times say.
                self.cadence.blocked(self._saver.blocked_s - self._blocked_mark)
        self._last_save_call = now
        self._blocked_mark = self._saver.blocked_s
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
        self._saver.wait(timeout_s, claim_wait_s)

    def restore(self, extra: Any = None) -> int:
        """Load the newest snapshot complete on every rank; returns its step (0: none).

        ``extra`` is what ``self.extra`` holds when nothing was restored.
        """
        self.extra = extra
        if not self.enabled:
            return 0
        restored, source = self._restorer.restore()
        self.resumed_from = restored
        self.source = source
        return restored

    def close(self) -> None:
        """Take the last step if the interval skipped it, wait for the copy, release buffers.

        Every rank calls it after training (the last snapshot is committed across ranks).
        """
        if self.enabled and self._unsaved is not None:
            step, extra = self._unsaved
            self._unsaved = None
            log.debug("close(): taking step %d, which the snapshot interval skipped", step)
            self._saver.snapshot(step, extra)
        # Training is over: nothing changes the state under the copy any more, so the last
        # snapshot may wait a little for its buffer (the others' copies of the step before).
        self.wait(claim_wait_s=max(self._wait_s, CLOSE_CLAIM_WAIT_S))
        if self.enabled and self._saver.skipped_saves:
            # Freshness, told: each skipped snapshot is a step a fault would have cost more.
            log.warning("rank %d: %s (training did not wait for them; a fault resumes from the "
                        "newest step every rank staged)", self._ctx.rank, self._saver.summary())
        self._release()

    def _release(self, abandon: bool = False) -> None:
        _OPEN.discard(self)
        if abandon:
            self._saver.abandon()
        else:
            self._saver.close()
        self._ctx.close()
