"""Restore from ``--persist-dir`` when memory holds nothing usable: collective, and never a
silent fresh start.

Every rank runs :func:`restore_from_disk` together (it is called from
``Snapshotter.restore()``). The ranks agree on what is on disk, then try the steps newest
first: a step that is not complete on disk (a node did not write its part, ranks of two
incarnations, an unreadable rank directory) is skipped, and so is a step whose shard fails
verification on *any* rank (a flipped byte, a missing file). Each skipped step is logged with
its reason, and every rank ends on the same step.

A step written by another number of ranks (N, this job M) is resharded: every rank checks
the xxh3 of the old ranks' shards ``j`` with ``j % M == rank``, then
``torch.distributed.checkpoint.load`` reads the step's one DCP checkpoint into the live
model's and optimizer's state dicts, so each rank gets its own shards of the global tensors
(DTensor placements of this job; plain tensors whole). What has no global form is taken per
rank from the old rank ``rank % N``: RNG states, ``extra``, ``state=`` objects, the
optimizer's hyper-parameters. A step whose model or optimizer holds a tensor that is not one
global tensor (a plain tensor that differs between the ranks that wrote it) cannot be
resharded and is refused, as is every step when the caller cannot give the live state.

When the directory holds steps but none can be restored, training does not start from 0
behind the user's back: :class:`~ftrun.errors.RestoreError` lists each step and why it was
refused, and says what to do, unless the job was started with ``--start-fresh``
(``FTRUN_START_FRESH=1``). An empty or missing directory is a normal fresh start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun import knobs
from ftrun.errors import FtrunError, IntegrityError, RestoreError
from ftrun.snapshot import persist

log = logging.getLogger(__name__)

Gather = Callable[[Any], list[Any]]
LiveState = Callable[[], dict[str, Any]]
RESHARDED_ROOTS = ("model", "optim")  # the state trees whose tensors are resharded


@dataclass(frozen=True)
class Refusal:
    """A persisted step that was not restored, and why."""

    step: int
    reason: str
    world_size: int | None = None  # the world size that wrote it, when known

    def __str__(self) -> str:
        return f"step {self.step}: {self.reason}"


@dataclass(frozen=True)
class DiskRestore:
    """What :func:`restore_from_disk` found: the step loaded (0: none) and its state tree."""

    step: int
    tree: Any
    world_size: int  # the world size that wrote the step
    refused: tuple[Refusal, ...]  # newer steps that were skipped


def gather_all(distributed: bool) -> Gather:
    """``all_gather_object`` over the default process group (the identity outside one)."""

    def gather(obj: Any) -> list[Any]:
        if not distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return gather


def _survey(root: str) -> dict[int, tuple[int | None, str | None]]:
    """step -> (world size, why it is not complete or None), as this rank sees the dir."""
    return {s.step: (s.world_size, s.why_incomplete) for s in persist.list_steps(root)}


def restore_from_disk(root: str, *, rank: int, world_size: int, gather: Gather,
                      start_fresh: bool | None = None,
                      live_state: LiveState | None = None) -> DiskRestore:
    """Load the newest step of ``root`` that is complete and verifies on every rank.

    Collective: every rank calls it with the same ``root``; ``gather`` is an all-gather of
    small objects. Returns the step (0 and no tree when nothing is there, or nothing usable
    and ``start_fresh``). Raises RestoreError when steps exist but none can be restored.
    ``live_state`` gives this rank's live ``{"model": ..., "optim": ...}`` state dicts (as
    ``torch.distributed.checkpoint.state_dict`` returns them): a step of another world size
    is resharded into their tensors; without it such a step is refused.
    """
    if start_fresh is None:
        start_fresh = knobs.START_FRESH.enabled()
    views = gather(_survey(root))
    steps = sorted({s for view in views for s in view}, reverse=True)
    refused: list[Refusal] = []
    for step in steps:
        reasons = [v[step][1] for v in views if step in v and v[step][1]]
        unseen = [r for r, v in enumerate(views) if step not in v]
        why = reasons[0] if reasons else None
        if why is None and unseen:
            why = (f"rank(s) {', '.join(map(str, unseen[:8]))} do not see it (is the directory "
                   "shared by every node?)")
        saved_world = next((v[step][0] for v in views if step in v and v[step][0]), None)
        if why is None and saved_world is None:
            why = "its world size is unknown"
        if why is not None:
            refused.append(Refusal(step, why))
            if rank == 0:
                log.warning("persisted step %d in %s is skipped: %s", step, root, why)
            continue
        assert saved_world is not None
        if saved_world == world_size:
            tree, problem = _load_own(root, step, rank)
            problems = gather(problem)
        else:
            tree, problems = _reshard(root, step, rank=rank, world_size=world_size,
                                      saved_world=saved_world, gather=gather,
                                      live_state=live_state)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if not bad:
            if saved_world != world_size and rank == 0:
                log.warning(
                    "persisted step %d was written by %d ranks, this job has %d: model and "
                    "optimizer resharded through torch.distributed.checkpoint; RNG states, "
                    "extra and state= objects are per rank: rank r took those of rank r %% %d",
                    step, saved_world, world_size, saved_world)
            return DiskRestore(step, tree, saved_world, tuple(refused))
        tree = None
        what = "; ".join(f"rank {r}: {p}" for r, p in bad[:3])
        more = f" (and {len(bad) - 3} more rank(s))" if len(bad) > 3 else ""
        verb = "fails verification" if saved_world == world_size else "cannot be resharded"
        refused.append(Refusal(step, f"{verb} on {what}{more}", saved_world))
        if rank == 0:
            log.warning("persisted step %d in %s is skipped: it %s on rank(s) %s; trying an "
                        "older step", step, root, verb, ", ".join(str(r) for r, _ in bad))
    if not steps:
        if rank == 0:
            log.info("nothing persisted in %s yet: starting fresh", root)
        return DiskRestore(0, None, world_size, ())
    listing = "\n".join(f"  {r}" for r in refused)
    other = sorted({r.world_size for r in refused
                    if r.world_size is not None and r.world_size != world_size})
    relaunch = (f" This job has {world_size} rank(s); {' and '.join(map(str, other))}-rank "
                f"step(s) restore as they are when relaunched with that many ranks."
                if other else "")
    if start_fresh:
        if rank == 0:
            log.warning("%s holds %d persisted step(s), none restorable:\n%s\n%s is set: "
                        "starting from step 0", root, len(steps), listing,
                        knobs.START_FRESH.name)
        return DiskRestore(0, None, world_size, tuple(refused))
    raise RestoreError(
        f"--persist-dir {root} holds {len(steps)} persisted step(s), but none can be "
        f"restored:\n{listing}\nNothing was loaded, so training does not start (it would "
        f"start from step 0). To resume, repair or bring back those files (`ftrun inspect "
        f"{root} --verify` shows each problem) or point --persist-dir at a directory with a "
        f"good step.{relaunch} To train from step 0 in this directory anyway, pass "
        f"--start-fresh (or set {knobs.START_FRESH.name}=1)."
    )


def _load_own(root: str, step: int, rank: int) -> tuple[Any, str]:
    """This rank's own shard of a step of this world size, verified: (tree, problem)."""
    try:
        return persist.load_rank(root, step, rank, verify=True), ""
    except FtrunError as e:
        problem = str(e)
    except OSError as e:
        problem = f"cannot read rank {rank}: {e}"
    log.error("rank %d: persisted step %d is not loadable: %s", rank, step, problem)
    return None, problem


def _reshard(root: str, step: int, *, rank: int, world_size: int, saved_world: int,
             gather: Gather, live_state: LiveState | None) -> tuple[Any, list[str]]:
    """Load a step of ``saved_world`` ranks onto this job's ``world_size`` (collective):
    (tree, every rank's problem). The tree is rank ``rank % saved_world``'s, with the tensors
    of its model and optimizer replaced by the live ones, filled from the step's checkpoint."""
    tree, problem = None, ""
    live: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    if live_state is None:
        problem = (f"it was written by {saved_world} ranks and this job has {world_size}; "
                   "in-memory state cannot be resharded without the live model")
    else:
        try:
            tree = persist.load_rank(root, step, rank % saved_world, verify=True)
            for old in range(rank, saved_world, world_size):
                if old != rank % saved_world:
                    bad = persist.verify_dir(persist.rank_dir(root, step, old))
                    if bad:
                        raise IntegrityError(f"{bad[0]}" + (f" (and {len(bad) - 1} more)"
                                                             if len(bad) > 1 else ""))
            layout = persist.step_layout(persist.read_step_dir(persist.step_dir(root, step)))
            live = live_state()
            flat = resharded_keys(tree, live, layout, saved_world)
        except FtrunError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot read step {step}: {e}"
    if problem:
        log.error("rank %d: persisted step %d cannot be restored onto %d ranks: %s", rank,
                  step, world_size, problem)
    problems = gather(problem)
    if any(problems):
        return None, problems
    # Every rank is ready: the load is collective.
    try:
        _dcp_load_global(flat, persist.step_dir(root, step))
        problem = ""
    except Exception as e:  # DCP wraps every rank's failure into CheckpointException
        problem = f"torch.distributed.checkpoint.load of {persist.step_dir(root, step)} failed: {e}"
        log.error("rank %d: %s", rank, problem)
    problems = gather(problem)
    if any(problems):
        return None, problems
    for name in RESHARDED_ROOTS:
        if name in tree:
            tree[name] = overlay(tree[name], live[name])
    return tree, problems


def resharded_keys(tree: Any, live: dict[str, Any], layout: persist.StepLayout,
                   saved_world: int) -> dict[str, Any]:
    """DCP key -> live tensor for every tensor of the model and optimizer; IntegrityError when
    the step cannot fill one of them (or holds one the live state lacks)."""
    from ftrun.snapshot.manifest import tensor_paths

    if not isinstance(tree, dict):
        raise IntegrityError("the persisted state is not a dict of model/optim/...")
    described = layout.metadata.state_dict_metadata
    rank_local = set(layout.rank_local)
    flat: dict[str, Any] = {}
    for name in RESHARDED_ROOTS:
        saved = {path for path, _ in tensor_paths(tree.get(name), (name,))}
        mine = dict(tensor_paths(live.get(name), (name,)))
        if saved != set(mine):
            odd = sorted("/" + "/".join(map(str, path)) for path in saved ^ set(mine))
            raise IntegrityError(
                f"the step's {name} and the live one hold different tensors ({', '.join(odd[:4])}"
                f"{', ...' if len(odd) > 4 else ''}): is this the same model and optimizer?")
        for path, tensor in mine.items():
            fqn = persist.dcp_key(path, layout.keys)
            if fqn in rank_local:
                raise IntegrityError(
                    f"tensor {fqn} is not one global tensor in the step: its {saved_world} "
                    "ranks hold different values of the same shape and it is not a DTensor, "
                    "so there is no telling how to split it onto another number of ranks")
            md = described.get(fqn)
            if md is None:
                raise IntegrityError(f"tensor {fqn} is missing from the step's metadata")
            if tuple(md.size) != tuple(tensor.shape):
                raise IntegrityError(f"tensor {fqn} has global shape {list(md.size)} in the "
                                     f"step and {list(tensor.shape)} in this job")
            flat[fqn] = tensor
    return flat


def _dcp_load_global(flat: dict[str, Any], path: Any) -> None:
    """Collective ``dcp.load``: each rank reads its shards of every tensor in ``flat``."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(path)),
                 no_dist=not (dist.is_available() and dist.is_initialized()))


def overlay(saved: Any, live: Any) -> Any:
    """``saved`` with each tensor replaced by the tensor at the same place in ``live``."""
    import torch

    if isinstance(saved, torch.Tensor):
        return live
    if isinstance(saved, dict):
        return {k: overlay(v, live[k]) if isinstance(live, dict) and k in live else v
                for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and \
            len(saved) == len(live):
        return type(saved)(overlay(a, b) for a, b in zip(saved, live, strict=True))
    return saved


def record_for_launcher(error: BaseException) -> None:
    """Put ``error`` in the worker's torch elastic error file, when there is one, so the
    launcher's failure summary (and ``ftrun status``) shows its message."""
    import os

    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    except Exception as e:  # noqa: BLE001 - a best effort on the way out
        log.debug("could not write the error file: %s", e)
