"""Every private part of Hugging Face transformers and accelerate that ftrun's integrations use.

The integrations (``ftrun.integrations.transformers`` and ``ftrun.integrations.accelerate``)
reach the frameworks' internals only through this module, so that a new release that moves
one of them breaks here, with a message, and in ``tests/test_hf.py``'s seam test, rather
than as a silent wrong resume. Each function says which internal it relies on and why no
public API serves.

Checked against transformers 5.23 and accelerate 1.15.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftrun.errors import ConfigError

# Trainer's own resume path, keyed on its ``resume_from_checkpoint`` argument, is where it
# skips the trained epochs and batches (``_init_training_state`` -> ``_run_epoch``).
RUN_EPOCH_PARAMS = ("model", "epoch", "train_dataloader", "num_update_steps_per_epoch",
                    "resume_from_checkpoint", "epochs_trained",
                    "steps_trained_in_current_epoch")
LOAD_RNG_PARAMS = ("checkpoint",)
# The training loop's running accounts (loss since the last log, total loss, the step of the
# last log, FLOPs not yet added to the state): set before on_train_begin, read when logging.
LOOP_ATTRS = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged", "current_flos")
# What ``Accelerator.save_state`` saves, held in these lists by ``Accelerator.prepare`` and
# ``register_for_checkpointing``; accelerate has no public accessor for them.
ACCELERATOR_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")
# accelerate's process-wide singletons (Borg classes over a class-level ``_shared_state``
# dict), each reset by its static ``_reset_state()``: what ``TrainingArguments`` itself calls
# before it sets up its state, and accelerate's tests between runs.
ACCELERATE_SINGLETONS = ("AcceleratorState", "PartialState", "GradientState")


class ResumeMarker(str):
    """The ``resume_from_checkpoint`` value ftrun hands the Trainer's epoch loop: it names no
    directory; the state was restored from an ftrun snapshot already."""


RESUMED_FROM_SNAPSHOT = ResumeMarker("<ftrun snapshot>")


def _params(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def check_trainer(trainer_cls: type) -> None:
    """Raise ConfigError unless ``trainer_cls`` has the two methods ftrun wraps, as expected."""
    for name, want in (("_run_epoch", RUN_EPOCH_PARAMS), ("_load_rng_state", LOAD_RNG_PARAMS)):
        fn = getattr(trainer_cls, name, None)
        have = _params(fn) if callable(fn) else None
        if have is None or not set(want) <= set(have):
            raise ConfigError(
                f"ftrun's Trainer integration resumes through {trainer_cls.__name__}.{name}"
                f"({', '.join(want)}), but transformers {_version('transformers')} has "
                f"{'no such method' if have is None else name + '(' + ', '.join(have) + ')'}: "
                "install a transformers version ftrun supports (5.x, tested with 5.23)")


def check_loop(trainer: Any) -> None:
    """Raise ConfigError unless the running training loop keeps the accounts ftrun restores."""
    missing = [a for a in LOOP_ATTRS if not hasattr(trainer, a)]
    if missing:
        raise ConfigError(
            f"the Trainer's training loop has no {', '.join(missing)} in transformers "
            f"{_version('transformers')}: install a version ftrun supports (5.x, tested "
            "with 5.23)")


def wrap_epoch_loop(trainer: Any, resume: Callable[[int, int], tuple[bool, int, int] | None]
                    ) -> None:
    """Make ``trainer``'s epoch loop resume where ``resume`` says, the way it resumes from a
    checkpoint directory.

    ``resume(epoch, num_update_steps_per_epoch)`` returns None (train the epoch as usual) or
    ``(skip, epochs_trained, batches_trained)``: skip the epoch altogether, or train it from
    the position given, as ``Trainer._run_epoch`` does for ``resume_from_checkpoint`` (it skips
    the batches with ``skip_first_batches`` and counts the steps from there). Its RNG reload
    from the checkpoint directory becomes a no-op: the snapshot's RNG states are applied at
    the first forward pass by the Snapshotter.

    Instance attributes shadow the class's methods, so any Trainer subclass (TRL's, a
    user's) keeps its own overrides underneath.
    """
    check_trainer(type(trainer))
    run_epoch = trainer._run_epoch
    load_rng_state = trainer._load_rng_state
    signature = inspect.signature(run_epoch)

    def _run_epoch(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        how = resume(bound.arguments["epoch"], bound.arguments["num_update_steps_per_epoch"])
        if how is not None:
            skip, epochs_trained, batches = how
            if skip:
                return None
            bound.arguments.update(resume_from_checkpoint=RESUMED_FROM_SNAPSHOT,
                                   epochs_trained=epochs_trained,
                                   steps_trained_in_current_epoch=batches)
        return run_epoch(*bound.args, **bound.kwargs)

    def _load_rng_state(checkpoint: Any) -> Any:
        if isinstance(checkpoint, ResumeMarker):
            return None
        return load_rng_state(checkpoint)

    trainer._run_epoch = _run_epoch
    trainer._load_rng_state = _load_rng_state


def loop_state(trainer: Any) -> dict[str, Any]:
    """The training loop's accounts (see LOOP_ATTRS), as of now."""
    tr_loss = trainer._tr_loss
    return {
        # Cloned: the loop adds to it in place while the snapshot is copied.
        "tr_loss": tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor) else tr_loss,
        "total_loss_scalar": float(trainer._total_loss_scalar),
        "globalstep_last_logged": int(trainer._globalstep_last_logged),
        "current_flos": float(trainer.current_flos),
    }


def set_loop_state(trainer: Any, state: dict[str, Any]) -> None:
    tr_loss = state["tr_loss"]
    if isinstance(tr_loss, torch.Tensor) and isinstance(trainer._tr_loss, torch.Tensor):
        tr_loss = tr_loss.to(trainer._tr_loss.device)
    trainer._tr_loss = tr_loss
    trainer._total_loss_scalar = state["total_loss_scalar"]
    trainer._globalstep_last_logged = state["globalstep_last_logged"]
    trainer.current_flos = state["current_flos"]


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state, for a training function that runs again in
    this process (``@ftrun.resilient``): ``PartialState`` initialises the process group once
    per process and keeps its rank, world size and device; after an in-place restart the
    group is gone and the world may differ, and ``Accelerator()`` would build on the old one
    (``prepare`` fails: no default process group). ``GradientState`` holds the old run's
    dataloaders and accumulation settings. Nothing is done when accelerate was never
    imported."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    missing = [n for n in ACCELERATE_SINGLETONS
               if not callable(getattr(getattr(state, n, None), "_reset_state", None))]
    if missing:
        raise ConfigError(
            f"accelerate {_version('accelerate')} has no _reset_state() on "
            f"{', '.join(missing)}: ftrun resets accelerate's state there before an in-place "
            "restart; install an accelerate version ftrun supports (1.x, tested with 1.15)")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (public attribute
    ``optimizer``): its ``step`` runs the step hooks the Snapshotter registers."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


@dataclass(frozen=True)
class AcceleratorParts:
    """What ``Accelerator.save_state`` saves, in its order."""
    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    dataloaders: list[Any]
    custom_objects: list[Any]


def accelerator_parts(accelerator: Any) -> AcceleratorParts:
    missing = [a for a in ACCELERATOR_LISTS if not isinstance(getattr(accelerator, a, None), list)]
    if missing:
        raise ConfigError(
            f"accelerate {_version('accelerate')}'s Accelerator keeps no {', '.join(missing)}: "
            "ftrun reads what save_state saves from there; install an accelerate version "
            "ftrun supports (1.x, tested with 1.15)")
    return AcceleratorParts(*(list(getattr(accelerator, a)) for a in ACCELERATOR_LISTS))
