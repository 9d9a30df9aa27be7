"""ftrun snapshots for the Hugging Face ``Trainer``: one line after building it.

::

    from ftrun.integrations.transformers import add_snapshots

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    add_snapshots(trainer, every="auto")        # or every=K; default: --snapshot-every
    trainer.train()

Under ``ftrun``, each rank snapshots its training state into the node's store every K
optimizer steps (or as often as keeps the slowdown at or below 3% with ``"auto"``). When
ftrun restarts the workers after a fault, ``trainer.train()`` resumes from the newest
snapshot that every rank holds, as ``train(resume_from_checkpoint=...)`` resumes from a
checkpoint directory, but from memory:

- the model (DDP's bucket layout included), the optimizer, the LR scheduler and the gradient
  scaler;
- the ``TrainerState`` progress: global step, epoch, ``log_history``, best metric and
  checkpoint, FLOPs and tokens seen; and the loop's running loss accounts, so that the logged
  losses and the final ``train_loss`` are the uninterrupted run's;
- the data position: the epochs already trained are skipped and the current one is
  fast-forwarded with ``skip_first_batches``, exactly where the Trainer's own resume does it
  (``args.ignore_data_skip`` is honoured);
- the RNG states (torch CPU and CUDA, numpy, Python), applied at the first forward pass;
- the state of ``ExportableState`` callbacks (early stopping) when
  ``args.restore_callback_states_from_checkpoint`` is set, as for a checkpoint.

What it adds to the Trainer: a callback (``SnapshotCallback``), which restores at
``on_train_begin`` (after the Trainer has wrapped the model and built the optimizer and
scheduler) and snapshots at ``on_step_begin`` (the state after the previous step, once that
step's logging, evaluation and saving are done) and at ``on_train_end``; and a wrapper on this
trainer's epoch loop (see ``ftrun.integrations._hf.wrap_epoch_loop``), because the loop's
start position is fixed before any callback runs and only its resume path skips data. No
subclass is needed: any Trainer subclass works.

Under plain ``python`` or ``torchrun`` the Snapshotter logs once that snapshots are off and
training runs as usual. ``trainer.train()`` is called once per Trainer (ftrun restarts the
process after a fault, or, under ``@ftrun.resilient``, the function that builds a new one;
importing this module registers the reset of accelerate's process-wide state that such a
re-run needs).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ftrun.errors import ConfigError
from ftrun.integrations import _hf
from ftrun.rank import resilient

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ftrun.integrations.transformers needs Hugging Face transformers: "
                      "pip install transformers") from e

__all__ = ["SnapshotCallback", "add_snapshots"]

log = logging.getLogger(__name__)

# Under @ftrun.resilient the training function runs again in this process after a fault:
# accelerate's process-wide state (which the Trainer uses too) must not outlive the old world.
resilient.before_rerun("accelerate's state", _hf.reset_accelerate_state)

# The TrainerState fields that are training progress (the rest follows from the arguments).
PROGRESS_FIELDS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history",
                   "best_metric", "best_global_step", "best_model_checkpoint")


def add_snapshots(trainer: Any, every: int | str | None = None) -> SnapshotCallback:
    """Give ``trainer`` ftrun snapshots and resume; returns the callback it added.

    ``every``: snapshot every K-th optimizer step, or ``"auto"``; None takes the launcher's
    ``--snapshot-every``. Call it before ``trainer.train()``.
    """
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(
            "add_snapshots() does not support DeepSpeed: its engine keeps the model and "
            "optimizer state in its own partitions, which ftrun's Snapshotter does not read. "
            "Train with DDP under ftrun, or keep DeepSpeed and its own checkpoints")
    callback = SnapshotCallback(trainer, every)
    trainer.add_callback(callback)
    _hf.wrap_epoch_loop(trainer, callback.resume_position)
    return callback


class SnapshotCallback(TrainerCallback):
    """Restores at ``on_train_begin``, snapshots at ``on_step_begin`` and ``on_train_end``.

    Made by ``add_snapshots``, which also wires the resume into the trainer's epoch loop; a
    callback alone cannot move the loop's start. ``snapshotter`` is the ``ftrun.Snapshotter``
    (None before training), ``resumed_from`` the step restored (0: a fresh start).
    """

    def __init__(self, trainer: Any, every: int | str | None = None) -> None:
        self.trainer = trainer
        self.every = every
        self.snapshotter: Any = None
        self.resumed_from = 0
        self._saved = 0  # the newest step handed to save()

    # -- restore ---------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import ftrun

        if self.snapshotter is not None:
            raise ConfigError(
                "trainer.train() ran a second time on this Trainer: ftrun resumes one "
                "train() per Trainer (a restart runs the script, or its @ftrun.resilient "
                "function, again); build a new Trainer and call add_snapshots() on it")
        trainer = self.trainer
        _hf.check_loop(trainer)
        stateful: dict[str, Any] = {}
        if trainer.lr_scheduler is not None:
            stateful["scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            stateful["scaler"] = scaler
        optimizer = _hf.torch_optimizer(trainer.optimizer)
        # model_wrapped is DDP(model) in a distributed run: the snapshot carries its buckets.
        self.snapshotter = ftrun.Snapshotter(trainer.model_wrapped, optimizer, state=stateful,
                                             every=self.every)
        checkpoint_step = state.global_step  # > 0: train(resume_from_checkpoint=...) loaded one
        step = self.snapshotter.restore()
        if not step:
            return
        if step < checkpoint_step:
            # The epoch loop already starts after the checkpoint's epochs: it cannot go back.
            raise ConfigError(
                f"train(resume_from_checkpoint=...) loaded step {checkpoint_step} from disk, but "
                f"ftrun's newest snapshot is the older step {step}: snapshot at least as often "
                "as you save checkpoints (add_snapshots(every=...), --snapshot-every), or do "
                "not pass resume_from_checkpoint to a job that ftrun restarts")
        extra = self.snapshotter.extra
        for name, value in json.loads(extra["trainer_state"]).items():
            setattr(state, name, value)
        _hf.set_loop_state(trainer, extra["loop"])
        if getattr(args, "restore_callback_states_from_checkpoint", False):
            self._load_callbacks(json.loads(extra["callbacks"]))
        self.resumed_from = self._saved = step
        # Said where default logging shows it (as Lightning's resume line is): a resume is what
        # a user looks for after a fault.
        log.warning("resumed the Trainer from step %d (epoch %.2f) of an ftrun snapshot (%s)",
                    step, state.epoch, self.snapshotter.source)

    def resume_position(self, epoch: int, steps_per_epoch: int) -> tuple[bool, int, int] | None:
        """For the epoch loop: None (as usual), or (skip it, epochs trained, batches trained)."""
        if not self.resumed_from:
            return None
        if 0 < self.trainer.state.max_steps <= self.resumed_from:
            # The snapshot is of the last step: nothing is left to train.
            self.trainer.control.should_training_stop = True
            return True, 0, 0
        epochs_trained, steps = divmod(self.resumed_from, steps_per_epoch)
        if epoch < epochs_trained:
            return True, 0, 0
        if epoch > epochs_trained:
            return None
        args = self.trainer.args
        batches = 0 if args.ignore_data_skip else steps * args.gradient_accumulation_steps
        return False, epochs_trained, batches

    def _load_callbacks(self, saved: dict[str, list[dict[str, Any]]]) -> None:
        """Set the saved attributes back on the ExportableState callbacks, as the Trainer's
        resume does (it builds new ones; these are the same objects, updated in place)."""
        for cb in self._exportable():
            states = saved.get(type(cb).__name__)
            if states:
                for name, value in states.pop(0).get("attributes", {}).items():
                    setattr(cb, name, value)

    def _exportable(self) -> list[Any]:
        return [cb for cb in self.trainer.callback_handler.callbacks
                if isinstance(cb, ExportableState)]

    # -- save ------------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The state after the previous optimizer step, with its log, evaluation and checkpoint
        # done: a resume starts the loop right here.
        if state.global_step > self._saved:
            self._save(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import ftrun

        ftrun.progress(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import ftrun

        if self.snapshotter is None:
            return
        if state.global_step > self._saved:
            self._save(state)
        ftrun.progress(state.global_step, done=True)
        self.snapshotter.close()

    def _save(self, state: Any) -> None:
        self._saved = state.global_step
        progress = {name: getattr(state, name) for name in PROGRESS_FIELDS}
        callbacks: dict[str, list[dict[str, Any]]] = {}
        for cb in self._exportable():
            callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        self.snapshotter.save(state.global_step, extra={
            "trainer_state": json.dumps(progress),
            "loop": _hf.loop_state(self.trainer),
            "callbacks": json.dumps(callbacks),
        })

