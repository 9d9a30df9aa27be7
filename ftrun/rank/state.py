"""A rank's training state as a snapshot holds it: captured from the model, optimizer,
``state=`` objects and RNGs (with DDP's bucket layout), and applied back on restore."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ftrun import _torch
from ftrun.errors import ConfigError
from ftrun.rank.rng import rng_state, set_rng_state

log = logging.getLogger("ftrun.rank.snapshotter")


def as_current(loaded: Any, current: Any) -> Any:
    """``loaded`` with every tensor that is a DTensor in ``current`` made one again.

    A snapshot holds a DTensor's local shard only; on the same world size the shard goes back
    with the live tensor's mesh, placements, shape and stride.
    """
    if isinstance(loaded, dict) and isinstance(current, dict):
        return {k: as_current(v, current.get(k)) for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)) and isinstance(current, (list, tuple)) and \
            len(loaded) == len(current):
        return type(loaded)(as_current(a, b) for a, b in zip(loaded, current, strict=True))
    if isinstance(loaded, torch.Tensor) and type(current).__name__ == "DTensor" and \
            type(loaded).__name__ != "DTensor":  # a resharded restore gives DTensors already
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(loaded.to(current.device), current.device_mesh,
                                  current.placements, shape=current.shape,
                                  stride=current.stride())
    return loaded


def check_stateful(state: Mapping[str, Any] | None) -> dict[str, Any]:
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


class TrainingState:
    """The state of one rank's training that a snapshot holds, and its capture and apply."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 state: Mapping[str, Any] | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.stateful = check_stateful(state)
        self._ddp_buckets: Any = None
        self.rng_restored: dict[str, Any] | None = None  # to apply at the next forward
        self.extra: Any = None

    def capture(self, step: int, extra: Any) -> dict[str, Any]:
        state = self.state_dicts()
        # Buffers change inside the next forward pass (batch-norm statistics, DDP's buffer
        # broadcast), which the background copy overlaps: take them now. They are small.
        buffers = {b.data_ptr() for b in self.model.buffers() if type(b) is torch.Tensor}
        state["model"] = {k: v.clone() if type(v) is torch.Tensor and v.data_ptr() in buffers
                          else v for k, v in state["model"].items()}
        state["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        state["rng"] = rng_state()
        layout = self.ddp_layout()
        if layout is not None:
            state["ddp_buckets"] = layout
        state["extra"] = extra
        state["step"] = step
        return state

    def ddp_layout(self) -> Any:
        """DDP's rebuilt bucket layout (see ftrun._torch), once it is known."""
        if self._ddp_buckets is None:
            ddp = _torch.ddp_of(self.model)
            if ddp is not None:
                self._ddp_buckets = _torch.ddp_layout(ddp)
        return self._ddp_buckets

    def apply(self, tree: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Snapshots hold each DTensor's local shard; give them back their placements.
        model_sd = as_current(tree["model"], get_model_state_dict(self.model))
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=True))
        if self.optimizer is not None and "optim" in tree and \
                not _torch.load_optimizer_state(self.model, self.optimizer, tree["optim"]):
            # Sharded (DTensor) state: torch's own path, which first materialises the
            # optimizer's state with a throw-away step to learn the placements.
            current = get_optimizer_state_dict(self.model, self.optimizer)
            set_optimizer_state_dict(self.model, self.optimizer,
                                     as_current(tree["optim"], current))
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
        self.rng_restored = tree["rng"]
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

    def state_dicts(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return out
