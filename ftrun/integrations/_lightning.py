"""The private parts of Lightning that ftrun's Lightning callback relies on, all in one place.

Each function names the Lightning internals it touches; ``tests/test_lightning.py`` checks that
they still exist with the signatures used here, so a Lightning upgrade that moves one fails
there, with the name of the seam, rather than in the middle of a resumed job. Supported:
``lightning`` and ``pytorch_lightning`` 2.x (the same code under two package names).

What a snapshot holds of the trainer is Lightning's own checkpoint dict
(``_CheckpointConnector.dump_checkpoint``) less the model's and the optimizer's state, which
ftrun's Snapshotter holds itself (as ``torch.distributed.checkpoint`` state dicts, sharded for
FSDP), and less the hyper-parameters (a restore does not read them; they may be any object).
A restore hands that dict to the connector's own ``restore_*`` steps, the ones
``Trainer.fit(ckpt_path=...)`` runs.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from ftrun.errors import ConfigError

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
# Keys of dump_checkpoint() a snapshot leaves out: the model and the optimizers (the
# Snapshotter holds them) and the hyper-parameters (only load_from_checkpoint reads them).
MODEL_KEYS = ("state_dict",)
OPTIMIZER_KEYS = ("optimizer_states",)
# What Lightning warns when it resumes a plain DataLoader mid-epoch (it starts the epoch over);
# resume_data_position() makes it resume where it was.
NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
HPARAM_KEYS = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
               "datamodule_hparams_name", "datamodule_hparams_type")


def frameworks() -> list[ModuleType]:
    """The Lightning packages to hook into: those already imported, else the first installed.

    ``lightning.pytorch`` and ``pytorch_lightning`` each have their own ``Callback`` class, and a
    Trainer accepts only callbacks of its own package.
    """
    loaded = [sys.modules[name] for name in PACKAGES if name in sys.modules]
    if loaded:
        return loaded
    for name in PACKAGES:
        try:
            return [importlib.import_module(name)]
        except ImportError:
            continue
    raise ConfigError("ftrun.integrations.lightning needs Lightning: pip install lightning "
                      "(or pytorch-lightning), version 2.x")


def framework_of(trainer: Any) -> ModuleType:
    """The Lightning package ``trainer`` comes from."""
    module = type(trainer).__module__
    for name in PACKAGES:
        if module.startswith(name + "."):
            return sys.modules[name]
    raise ConfigError(f"{type(trainer).__qualname__} from {module} is not a Lightning Trainer")


def dump(trainer: Any, with_optimizers: bool) -> dict[str, Any]:
    """The trainer's checkpoint dict without model weights and hyper-parameters (see above).

    Loops (the fit loop's counters, and a stateful data loader's position), callbacks, LR
    schedulers, the precision plugin (e.g. its GradScaler), a datamodule's ``state_dict``, and
    whatever ``on_save_checkpoint`` hooks add; the optimizers' states when ``with_optimizers``.
    """
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    drop = MODEL_KEYS + HPARAM_KEYS + (() if with_optimizers else OPTIMIZER_KEYS)
    return {k: v for k, v in checkpoint.items() if k not in drop}


def apply(trainer: Any, checkpoint: dict[str, Any]) -> bool:
    """Restore the trainer from ``checkpoint`` (a :func:`dump`) as a ``ckpt_path`` would.

    Called after the strategy set up the model and optimizers, before the fit loop starts.
    Returns whether a ``ckpt_path`` checkpoint was pending (its training state is dropped: the
    snapshot is newer).
    """
    connector = trainer._checkpoint_connector
    pending = bool(connector._loaded_checkpoint)
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_datamodule()
        # restore_model() calls this hook, then loads weights the snapshot already loaded.
        trainer.lightning_module.on_load_checkpoint(checkpoint)
        connector.restore_callbacks()
        connector.restore_precision_plugin_state()
        connector.restore_loops()
        if OPTIMIZER_KEYS[0] in checkpoint:
            connector.restore_optimizers()
        connector.restore_lr_schedulers()
    finally:
        # Nothing left for the Trainer's own restore_training_state() to apply.
        connector._loaded_checkpoint = {}
    return pending


def loads_checkpoint_after_callbacks(trainer: Any) -> bool:
    """Whether the strategy loads ``ckpt_path`` after the callbacks' ``on_fit_start`` (FSDP,
    DeepSpeed, ModelParallel): it would then overwrite the restored snapshot."""
    return bool(trainer.ckpt_path) and bool(trainer.strategy.restore_checkpoint_after_setup)


class SkipSampler:
    """The sampler of a batch sampler, minus the positions the restored run already trained.

    ``BatchSampler`` cuts consecutive batches from its sampler's order, so leaving out the first
    ``skip`` positions leaves out exactly the first ``skip / batch_size`` batches. After one
    iteration it puts the original sampler back (the next epoch starts at its beginning).
    """

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = batch_sampler.sampler
        self.skip = skip

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.batch_sampler.sampler = self.sampler
        return itertools.islice(iter(self.sampler), self.skip, None)


def _stateful(loader: Any) -> bool:
    # What Lightning's _Stateful protocol checks: such a loader's position is in the fit loop's
    # state ("combined_loader") and restored by Lightning itself.
    return callable(getattr(loader, "state_dict", None)) and \
        callable(getattr(loader, "load_state_dict", None))


def resume_data_position(trainer: Any) -> int:
    """Start the restored epoch's training data after the batches already trained.

    Lightning resumes a stateful loader (torchdata's ``StatefulDataLoader``) mid-epoch by
    itself. A plain ``DataLoader`` it starts over at the epoch's first batch; here its batch
    sampler skips the trained ones, and the fit loop gets a fresh iterator (the one it made
    before this hook may have pulled indices already, in worker processes). Called from
    ``on_train_start``, after the fit loop restored its counters. Returns the batches skipped.
    """
    fit_loop = trainer.fit_loop
    done = fit_loop.epoch_loop.batch_progress.current.processed
    if not fit_loop.restarting or done <= 0 or done >= trainer.num_training_batches:
        return 0
    combined = fit_loop._combined_loader
    loaders = list(combined.flattened)
    plain = [dl for dl in loaders if not _stateful(dl)]
    if not plain:
        return 0
    if len(plain) != len(loaders):
        raise ConfigError(
            "the training data mixes stateful loaders (state_dict/load_state_dict) and plain "
            "DataLoaders; ftrun cannot resume such a mix mid-epoch: make them all "
            "torchdata.stateful_dataloader.StatefulDataLoader, or all plain DataLoaders")
    epoch = fit_loop.epoch_progress.current.processed
    for dl in plain:
        batch_sampler = getattr(dl, "batch_sampler", None)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if batch_sampler is None or getattr(batch_sampler, "sampler", None) is None or \
                not isinstance(batch_size, int):
            raise ConfigError(
                f"cannot resume the training {type(dl).__qualname__} mid-epoch: it has no "
                "batch sampler with a sampler and a batch size (an IterableDataset, or a custom "
                "batch_sampler). Use torchdata.stateful_dataloader.StatefulDataLoader, whose "
                "position Lightning saves and restores")
        for sampler in {id(s): s for s in (dl.sampler, batch_sampler.sampler)}.values():
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # before any index is drawn (Lightning sets it later)
        batch_sampler.sampler = SkipSampler(batch_sampler, done * batch_size)
    iter(fit_loop._data_fetcher)  # a new iterator over the (now skipping) samplers
    return done
