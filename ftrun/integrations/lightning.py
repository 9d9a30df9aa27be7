"""ftrun snapshots for PyTorch Lightning: one callback.

::

    from ftrun.integrations.lightning import FtrunSnapshots

    trainer = L.Trainer(strategy="ddp", callbacks=[FtrunSnapshots()], ...)
    trainer.fit(model, datamodule=dm)

Run the script with ``ftrun`` as with ``torchrun`` (``devices`` and ``num_nodes`` must match
the launcher's ``--nproc-per-node`` and ``--nnodes``: Lightning checks it). Every ``every``
optimizer steps (``FTRUN_SNAPSHOT_EVERY`` by default: 1, or ``"auto"``) the callback snapshots
the rank's training state into ftrun's store. When ftrun restarts the workers after a fault,
``fit()`` resumes from the newest snapshot every rank holds, as from a checkpoint: the
weights and optimizer state, LR schedulers, the precision plugin (GradScaler), the fit loop's
counters, the data position mid-epoch, the callbacks' and datamodule's state, and the RNGs.

A callback and not a ``CheckpointIO`` plugin: a CheckpointIO only chooses where rank 0 writes
the file that a ``ModelCheckpoint`` decided to write, and resuming from it needs a path passed
to ``fit``. ftrun's snapshots are per rank, taken after the optimizer step and copied in the
background, and restored by a collective that picks the newest step complete on every rank;
a callback has the hooks for exactly those moments (``on_fit_start`` after the strategy has
wrapped the model and built the optimizers, ``on_train_batch_end`` after the step) and needs
no change to the rest of the script. Lightning's own fault-tolerance pieces
(``ModelCheckpoint``, ``OnExceptionCheckpoint``) are callbacks too.

Under plain ``python`` or ``torchrun`` the callback says once that snapshots are off and does
nothing else. The Lightning internals it uses are in ``ftrun.integrations._lightning``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

from ftrun import knobs
from ftrun.integrations import _lightning

__all__ = ["FtrunSnapshots"]  # noqa: F822 (made on first use, by __getattr__)

log = logging.getLogger(__name__)


class _SnapshotsCallback:
    """The callback's behaviour; :data:`FtrunSnapshots` adds Lightning's ``Callback`` base.

    ``every``: snapshot interval in optimizer steps, or ``"auto"`` (None: ftrun's default,
    ``FTRUN_SNAPSHOT_EVERY``). Attributes after ``fit`` started: ``snapshotter`` (the
    ``ftrun.Snapshotter``, None outside ftrun), ``resumed_from`` (the step restored, 0 for
    none), ``skipped_batches`` (batches of a plain DataLoader skipped to resume mid-epoch).
    """

    def __init__(self, every: int | str | None = None) -> None:
        super().__init__()
        self.every = every
        self.snapshotter: Any = None
        self.resumed_from = 0
        self.skipped_batches = 0
        self._last_step = -1
        self._own_optimizer = False

    # -- start: build the Snapshotter, restore ------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl = _lightning.framework_of(trainer)
        if not knobs.STORE.get():
            pl.utilities.rank_zero_info(
                "ftrun snapshots are off: not started by ftrun. Training runs as usual; run "
                "the script with `ftrun` to snapshot the trainer's state every step.")
            return
        if _lightning.loads_checkpoint_after_callbacks(trainer):
            from ftrun.errors import ConfigError

            raise ConfigError(
                f"{type(trainer.strategy).__name__} loads ckpt_path={trainer.ckpt_path!r} after "
                "the callbacks' on_fit_start, over the ftrun snapshot a restarted job resumes "
                "from: under ftrun, leave ckpt_path out (the job's first start can load the "
                "checkpoint's weights in the LightningModule), or use strategy='ddp'")
        import ftrun

        optimizers = list(trainer.optimizers)
        # One optimizer: the Snapshotter holds it (sharded state for FSDP, and its step
        # pre-hook keeps the background copy and the parameter update apart). Several (manual
        # optimisation): their states go with Lightning's checkpoint dict.
        self._own_optimizer = len(optimizers) == 1
        trainer_state = _TrainerState(trainer, not self._own_optimizer)
        self.snapshotter = ftrun.Snapshotter(
            trainer.strategy.model, optimizers[0] if self._own_optimizer else None,
            state={"lightning": trainer_state}, every=self.every, forward_hooks=False,
            optimizer_hook=False)
        step = self.snapshotter.restore()
        self.resumed_from = step
        if step:
            self._last_step = step
            pl.utilities.rank_zero_info(
                f"ftrun: resumed from the snapshot of step {step} ({self.snapshotter.source}): "
                f"epoch {trainer.current_epoch}, global step {trainer.global_step}")
            if trainer_state.dropped_ckpt_path:
                pl.utilities.rank_zero_info(
                    f"ftrun: the snapshot of step {step} is newer than ckpt_path="
                    f"{trainer.ckpt_path!r}; its training state was not applied")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.resumed_from:
            return
        self.skipped_batches = _lightning.resume_data_position(trainer)
        if self.skipped_batches:
            # Lightning warns next that a plain DataLoader cannot resume mid-epoch: this one does.
            warnings.filterwarnings("ignore", message=_lightning.NOT_RESUMABLE_WARNING)
            _lightning.framework_of(trainer).utilities.rank_zero_info(
                f"ftrun: the training data resumes after the {self.skipped_batches} batches of "
                f"epoch {trainer.current_epoch} already trained")

    # -- every step: save ---------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        # Where a snapshot's RNG states are taken, and a restored run's put back: right before
        # the training step, in the uninterrupted run and the restored one alike. Not at the
        # model's forward (the Snapshotter's default): Lightning runs validation through the
        # same forward, and a restored run does not repeat the validation that came between
        # the snapshot and the next step. Nor does every strategy run training_step through
        # the wrapped model's forward (single device, ModelParallel/FSDP2).
        if self.snapshotter is not None:
            self.snapshotter.step_begins()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Keep the parameter update off the copy in flight. Here, not in an optimizer step
        # pre-hook: Lightning calls optimizer.step(closure) with the training step's forward
        # and backward inside the closure, which runs after the pre-hooks and before this
        # hook, so waiting here lets the copy overlap them.
        if self.snapshotter is not None:
            self.snapshotter.before_optimizer_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.snapshotter is None or step <= self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = step
        self.snapshotter.save(step)
        import ftrun

        ftrun.progress(step)

    # -- end ------------------------------------------------------------------------------------

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.snapshotter is not None:
            import ftrun

            ftrun.progress(trainer.global_step, done=True)
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.snapshotter is not None:
            snap, self.snapshotter = self.snapshotter, None
            snap.close()


class _TrainerState:
    """The trainer's share of a snapshot, as a ``state=`` object of the Snapshotter."""

    def __init__(self, trainer: Any, with_optimizers: bool) -> None:
        self.trainer = trainer
        self.with_optimizers = with_optimizers
        self.dropped_ckpt_path = False  # a ckpt_path checkpoint the restore overrode

    def state_dict(self) -> dict[str, Any]:
        return _lightning.dump(self.trainer, self.with_optimizers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropped_ckpt_path = _lightning.apply(self.trainer, state)


@functools.cache
def _callback_class() -> type:
    # Lightning's Callback of every Lightning package in use, so that either Trainer takes it.
    bases = tuple(pl.Callback for pl in _lightning.frameworks())
    return type("FtrunSnapshots", (_SnapshotsCallback, *bases), {
        "__module__": __name__, "__doc__": _SnapshotsCallback.__doc__,
        "__qualname__": "FtrunSnapshots"})


def __getattr__(name: str) -> Any:
    # Lightning is imported when the callback is first asked for, not with ftrun.
    if name == "FtrunSnapshots":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
