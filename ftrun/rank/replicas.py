"""Which of a rank's snapshotted tensors must be bit-identical on other ranks (its replicas).

Two layouts are known:

- **DDP** (``ftrun._torch.ddp_of``): every parameter of the wrapped module, and the optimizer
  state of those parameters, is the same on every rank of DDP's process group after each
  optimizer step (the gradients are all-reduced, so every replica takes the same step). Not
  the buffers: DDP broadcasts them at the *start* of a forward, and batch-norm statistics
  then move with each rank's own batch. Not a ``ZeroRedundancyOptimizer``'s state: each rank
  holds its own part. Nothing at all under local SGD (``PostLocalSGDOptimizer``): its replicas
  differ by design between two averagings.
- **DTensor** (FSDP2/HSDP, tensor parallel): a tensor whose placements include
  ``Replicate()`` holds the same shard on every rank that shares its coordinates on the
  mesh's other dimensions. A DTensor sharded on every dimension has no replica: nothing to
  compare.

Plain tensors outside DDP are never assumed replicated: a false assumption would be a false
corruption finding.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from ftrun import _torch
from ftrun.snapshot.manifest import Flattened, tensor_paths
from ftrun.snapshot.replicas import Group

log = logging.getLogger("ftrun.rank.snapshotter")

_REPLICATED_ROOTS = ("model", "optim")
# Optimizers whose DDP replicas step apart and are averaged now and then.
_LOCAL_SGD = frozenset({"PostLocalSGDOptimizer"})


def _key(path: tuple[Any, ...]) -> str:
    """A tensor's manifest key, as ``flatten`` names it."""
    return "".join(f"/{p}" for p in path)


def _ddp_group(model: torch.nn.Module) -> tuple[str, bool, set[str]] | None:
    """(group name, lead, parameter names) of a DDP module with more than one replica."""
    ddp = _torch.ddp_of(model)
    if ddp is None:
        return None
    import torch.distributed as dist

    ranks = sorted(int(r) for r in dist.get_process_group_ranks(ddp.process_group))
    if len(ranks) < 2:
        return None
    name = "ddp:" + hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return name, dist.get_rank() == ranks[0], {n for n, _ in ddp.module.named_parameters()}


def _dtensor_group(t: Any) -> tuple[str, bool] | None:
    """(group name, lead) of a DTensor with a Replicate placement; None without one."""
    placements = [str(p) for p in t.placements]
    replicate = [i for i, p in enumerate(t.placements) if p.is_replicate()]
    coord = t.device_mesh.get_coordinate()
    if not replicate or coord is None:
        return None
    if all(t.device_mesh.shape[i] < 2 for i in replicate):
        return None
    # Replicas share every coordinate but the replicated dimensions'.
    fixed = [c if i not in replicate else "*" for i, c in enumerate(coord)]
    name = f"dtensor:{list(t.device_mesh.shape)}:{placements}:{fixed}"
    return name, all(coord[i] == 0 for i in replicate)


def groups(state: dict[str, Any], model: torch.nn.Module, optimizer: Any,
           flat: Flattened) -> list[Group]:
    """The replica groups of the tensors in ``flat`` (captured from ``state``), in order."""
    index = {e.key: i for i, e in enumerate(flat.tensors)}
    ddp = _ddp_group(model) if type(optimizer).__name__ not in _LOCAL_SGD else None
    sharded_optim = type(optimizer).__name__ == "ZeroRedundancyOptimizer"
    found: dict[str, tuple[bool, list[int]]] = {}
    for root in _REPLICATED_ROOTS:
        for path, t in tensor_paths(state.get(root), (root,)):
            i = index.get(_key(path))
            if i is None:
                continue
            if type(t).__name__ == "DTensor":
                g = _dtensor_group(t)
            elif ddp is not None and _ddp_param(path, ddp[2], sharded_optim):
                g = ddp[:2]
            else:
                g = None
            if g is not None:
                found.setdefault(g[0], (g[1], []))[1].append(i)
    return [Group(name, lead, tuple(ix)) for name, (lead, ix) in found.items()]


def _ddp_param(path: tuple[Any, ...], params: set[str], sharded_optim: bool) -> bool:
    """A parameter of the DDP module (``("model", fqn)``), or its optimizer state
    (``("optim", "state", fqn, ...)``)."""
    if path[0] == "model":
        return len(path) == 2 and path[1] in params
    return (not sharded_optim and len(path) >= 4 and path[1] == "state"
            and path[2] in params)
