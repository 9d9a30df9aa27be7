"""Restore from ``--persist-dir`` when memory holds nothing usable: collective, and never a
silent fresh start.

Every rank runs :func:`restore_from_disk` together (it is called from
``Snapshotter.restore()``). The ranks agree on what is on disk, then try the steps newest
first: a step that is not complete on disk (a node did not write its part, ranks of two
incarnations, an unreadable rank directory) is skipped, and so is a step whose shard fails
verification on *any* rank (a flipped byte, a missing file). Each skipped step is logged with
its reason, and every rank ends on the same step.

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
from ftrun.errors import FtrunError, RestoreError
from ftrun.snapshot import persist

log = logging.getLogger(__name__)

Gather = Callable[[Any], list[Any]]


@dataclass(frozen=True)
class Refusal:
    """A persisted step that was not restored, and why."""

    step: int
    reason: str

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
                      start_fresh: bool | None = None) -> DiskRestore:
    """Load the newest step of ``root`` that is complete and verifies on every rank.

    Collective: every rank calls it with the same ``root``; ``gather`` is an all-gather of
    small objects. Returns the step (0 and no tree when nothing is there, or nothing usable
    and ``start_fresh``). Raises RestoreError when steps exist but none can be restored.
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
        shard = rank if rank < saved_world else 0
        tree: Any = None
        problem = ""
        try:
            tree = persist.load_rank(root, step, shard, verify=True)
        except FtrunError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot read rank {shard}: {e}"
        if problem:
            log.error("rank %d: persisted step %d is not loadable: %s", rank, step, problem)
        problems = gather(problem)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if not bad:
            if saved_world != world_size and rank == 0:
                log.warning("persisted step %d was written by %d ranks, this job has %d: ranks "
                            "below %d load their own shard, the others rank 0's", step,
                            saved_world, world_size, saved_world)
            return DiskRestore(step, tree, saved_world, tuple(refused))
        tree = None
        what = "; ".join(f"rank {r}: {p}" for r, p in bad[:3])
        more = f" (and {len(bad) - 3} more rank(s))" if len(bad) > 3 else ""
        refused.append(Refusal(step, f"fails verification on {what}{more}"))
        if rank == 0:
            log.warning("persisted step %d in %s is skipped: it fails verification on rank(s) "
                        "%s; trying an older step", step, root, ", ".join(str(r) for r, _ in bad))
    if not steps:
        if rank == 0:
            log.info("nothing persisted in %s yet: starting fresh", root)
        return DiskRestore(0, None, world_size, ())
    listing = "\n".join(f"  {r}" for r in refused)
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
        f"good step. To train from step 0 in this directory anyway, pass --start-fresh "
        f"(or set {knobs.START_FRESH.name}=1)."
    )


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
