"""ftrun snapshots for scripts that use Hugging Face Accelerate.

::

    from ftrun.integrations.accelerate import AcceleratorSnapshotter

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    snap = AcceleratorSnapshotter(accelerator, model, every="auto")   # after prepare()
    step = snap.restore()                       # collective; 0 on a fresh start
    first_epoch, done = divmod(step, len(loader))
    for epoch in range(first_epoch, epochs):
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        done = 0
        for batch in batches:
            ...accelerator.backward(loss); optimizer.step(); scheduler.step()...
            step += 1
            snap.save(step)                     # right after the optimizer step
    snap.close()

A snapshot holds what ``Accelerator.save_state`` saves, taken into the node's ftrun store
instead of a directory:

- the prepared model (DDP's bucket layout included) and optimizer, through
  ``ftrun.Snapshotter``;
- the prepared schedulers, the gradient scaler, the objects registered with
  ``accelerator.register_for_checkpointing`` and ``accelerator.step``;
- the position of each prepared dataloader: its epoch counter and the state its shuffling
  generator had when the epoch began (accelerate seeds one generator per dataloader and
  draws every epoch's order from it, so a resume in a later epoch needs it; ``save_state``
  keeps it only for a ``SeedableRandomSampler``), and with ``use_stateful_dataloader`` the
  loader's own state;
- the RNG states (torch CPU and CUDA, numpy, Python), applied at the first forward pass;
- your ``extra`` tree (``save(step, extra=...)``, ``snap.extra`` after ``restore()``).

Which batches of the epoch were trained is the script's count, as with ``load_state``:
``accelerator.skip_first_batches(loader, done)`` for the first epoch after a resume. With
``DataLoaderConfiguration(use_seedable_sampler=True)``, call ``loader.set_epoch(epoch)`` each
epoch (the loader that ``skip_first_batches`` returns counts its epochs apart from yours).

Under plain ``python`` or ``torchrun`` the Snapshotter logs once that snapshots are off,
``save()`` does nothing and ``restore()`` returns 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ftrun.errors import ConfigError
from ftrun.integrations import _hf
from ftrun.rank import resilient

__all__ = ["AcceleratorSnapshotter"]

log = logging.getLogger(__name__)

# Under @ftrun.resilient the training function runs again in this process after a fault:
# accelerate's process-wide state (which the Trainer uses too) must not outlive the old world.
resilient.before_rerun("accelerate's state", _hf.reset_accelerate_state)


class LoaderPosition:
    """Where a prepared dataloader's current epoch began: its epoch counter (``iteration``)
    and, for a shuffled loader, the state of its ``synchronized_generator`` before it drew
    the epoch's order.

    Recorded by wrapping this loader's ``set_epoch``, which ``DataLoaderShard.__iter__`` calls
    after synchronising the generator across ranks and before the sampler draws from it.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.generator: torch.Generator | None = getattr(loader, "synchronized_generator", None)
        self.iteration = int(getattr(loader, "iteration", 0))
        self.generator_state = self.generator.get_state() if self.generator is not None else None
        # After a restore: (the restored epoch, the generator's state after that epoch's
        # draws), until the script's next set_epoch says which epoch it trains.
        self._restored: tuple[int, torch.Tensor] | None = None
        set_epoch = getattr(loader, "set_epoch", None)
        if callable(set_epoch):
            def record_then_set_epoch(epoch: int) -> None:
                self._next_epoch_after_restore(int(epoch))
                self.iteration = int(epoch)
                if self.generator is not None:
                    self.generator_state = self.generator.get_state()
                set_epoch(epoch)

            loader.set_epoch = record_then_set_epoch

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"iteration": self.iteration}
        if self.generator_state is not None and self.generator is not None:
            out["generator"] = self.generator_state
            # Every draw of the epoch comes before its first batch (the base seed, the
            # sampler's order), so this is where the next epoch's draws begin: a snapshot
            # of an epoch's last step resumes there.
            out["generator_after"] = self.generator.get_state()
        return out

    def load(self, saved: Mapping[str, Any]) -> None:
        self._restored = None
        if "generator" in saved and self.generator is not None:
            self.generator.set_state(saved["generator"])
        # Through the wrapper: sets the loader's and its samplers' epoch, and records it.
        self.loader.set_epoch(int(saved["iteration"]))
        if "generator_after" in saved and self.generator is not None:
            self._restored = (int(saved["iteration"]), saved["generator_after"])

    def _next_epoch_after_restore(self, epoch: int) -> None:
        """The first set_epoch after a restore: a later epoch than the snapshot's (it was of
        the epoch's last step) draws from where the snapshot's epoch left the generator, as
        the uninterrupted run's next epoch did; the same epoch draws its order again from
        the epoch's start (restored already)."""
        restored, self._restored = self._restored, None
        if restored is not None and epoch > restored[0] and self.generator is not None:
            self.generator.set_state(restored[1])


class AcceleratorSnapshotter:
    """ftrun snapshots of everything ``accelerator.save_state`` would save; see the module
    docstring. Build it after ``accelerator.prepare`` and ``register_for_checkpointing``.

    ``model`` is the model as ``prepare`` returned it: in a distributed run that is the DDP
    wrapper, whose gradient bucket layout the snapshot carries (the accelerator itself keeps
    only the unwrapped model). ``every``: snapshot every K-th step, or ``"auto"``; None takes the launcher's
    ``--snapshot-every``. ``state``: more ``Stateful`` objects to snapshot (names must not
    clash with ``scheduler``/``scaler``/``custom``/``loader`` entries).
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, *,
                 every: int | str | None = None, state: Mapping[str, Any] | None = None) -> None:
        import ftrun

        self.accelerator = accelerator
        parts = _hf.accelerator_parts(accelerator)
        if len(parts.models) != 1 or len(parts.optimizers) > 1:
            raise ConfigError(
                f"AcceleratorSnapshotter snapshots one prepared model and at most one optimizer; "
                f"this accelerator has {len(parts.models)} model(s) and {len(parts.optimizers)} "
                "optimizer(s). Prepare one model (and one optimizer) with this accelerator, or "
                "use ftrun.Snapshotter directly with the others in state=")
        if accelerator.unwrap_model(model) is not parts.models[0]:
            raise ConfigError(
                f"model ({type(model).__qualname__}) is not the model this accelerator "
                "prepared: pass the model accelerator.prepare() returned")
        stateful: dict[str, Any] = {}
        for i, scheduler in enumerate(parts.schedulers):
            stateful[f"scheduler_{i}"] = scheduler
        if accelerator.scaler is not None:
            stateful["scaler"] = accelerator.scaler
        for i, obj in enumerate(parts.custom_objects):
            stateful[f"custom_{i}"] = obj
        for i, loader in enumerate(parts.dataloaders):
            if getattr(loader, "use_stateful_dataloader", False):
                stateful[f"loader_{i}"] = loader
        for name, obj in (state or {}).items():
            if name in stateful:
                raise ConfigError(f"state={name!r} clashes with the accelerator's own "
                                  f"{name!r}: choose another name")
            stateful[name] = obj
        self.loaders = [LoaderPosition(loader) for loader in parts.dataloaders]
        optimizer = _hf.torch_optimizer(parts.optimizers[0]) if parts.optimizers else None
        self.snapshotter = ftrun.Snapshotter(model, optimizer, state=stateful, every=every)

    @property
    def enabled(self) -> bool:
        return bool(self.snapshotter.enabled)

    @property
    def extra(self) -> Any:
        """Your ``extra`` tree of the restored snapshot (or what ``restore(extra=)`` got)."""
        tree = self.snapshotter.extra
        return tree.get("user") if isinstance(tree, dict) else tree

    @property
    def resumed_from(self) -> int:
        return int(self.snapshotter.resumed_from)

    @property
    def source(self) -> str:
        return str(self.snapshotter.source)

    def restore(self, extra: Any = None) -> int:
        """Collective: load the newest snapshot every rank holds; its step (0: none)."""
        step = self.snapshotter.restore(extra={"user": extra})
        if not step:
            return 0
        saved = self.snapshotter.extra["accelerate"]
        if len(saved["loaders"]) != len(self.loaders):
            raise ConfigError(
                f"the snapshot of step {step} holds {len(saved['loaders'])} dataloader "
                f"position(s), this accelerator prepared {len(self.loaders)}: prepare the same "
                "dataloaders as the run that wrote it, or start the job afresh")
        for position, loader_state in zip(self.loaders, saved["loaders"], strict=True):
            position.load(loader_state)
        self.accelerator.step = saved["step"]
        log.warning("restored the accelerator's state at step %d from an ftrun snapshot (%s)",
                    step, self.snapshotter.source)  # shown by default logging, as Lightning's
        return step

    def save(self, step: int, extra: Any = None) -> bool:
        """Snapshot the state after ``step`` (right after the optimizer step)."""
        return self.snapshotter.save(step, extra={
            "user": extra,
            "accelerate": {"step": int(self.accelerator.step),
                           "loaders": [p.state() for p in self.loaders]},
        })

    def wait(self) -> None:
        self.snapshotter.wait()

    def close(self) -> None:
        """Take the last step if the interval skipped it and release the buffers; every rank
        calls it after training."""
        self.snapshotter.close()
