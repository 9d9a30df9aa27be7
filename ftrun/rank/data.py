"""``ResumableDistributedSampler``: a data position that survives a change of world size.

The contract (docs/snapshots.md, "Data position across a change of world size"): each epoch
has one global order of the dataset's indices, a permutation seeded with ``seed + epoch``
(the same one ``torch.utils.data.DistributedSampler`` draws). A step consumes the next
``world_size * per_rank_batch`` positions of that order, rank ``r`` taking positions ``r``,
``r + world_size``, ... of them. The data position is therefore two numbers that every rank
agrees on, whatever the world size: the epoch and the number of positions consumed in it.
Given them, any number of ranks splits the rest of the epoch the same way, so no sample is
skipped or repeated when the world size changes between two steps.

::

    sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0)
    snap = ftrun.Snapshotter(model, optimizer)
    step = snap.restore(extra={"epoch": 0, "consumed": 0})
    epoch, consumed = snap.extra["epoch"], snap.extra["consumed"]
    while epoch < epochs:
        sampler.set_epoch(epoch, consumed)
        for x, y in DataLoader(dataset, batch_size=b, sampler=sampler):
            ...forward, backward, optimizer.step()...
            step += 1
            consumed += len(x) * sampler.num_replicas   # what all ranks took, together
            snap.save(step, extra={"epoch": epoch, "consumed": consumed})
        epoch, consumed = epoch + 1, 0
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["ResumableDistributedSampler"]


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler`` that starts an epoch at any position, on any number of ranks.

    ``dataset`` is a sized dataset or its length. ``num_replicas`` and ``rank`` default to the
    process group's (1 and 0 without one). ``shuffle``, ``seed`` and ``drop_last`` mean what
    they mean for ``DistributedSampler``; with ``set_epoch(epoch)`` (nothing consumed) this
    sampler yields exactly the indices ``DistributedSampler`` yields.

    ``set_epoch(epoch, consumed)`` starts the epoch at position ``consumed`` of its order:
    iteration yields this rank's share of the positions ``consumed, consumed + 1, ...``, in
    turn: ``consumed + rank``, ``consumed + rank + num_replicas``, ... At the end of the epoch
    the rest is evened out over the ranks as ``DistributedSampler`` does: ``drop_last`` leaves
    out the last ``rest % num_replicas`` positions; otherwise the order is continued from its
    start (repeating up to ``num_replicas - 1`` samples) until every rank has as many.

    ``stream(epoch, consumed)`` yields this rank's share of the endless sequence of epochs
    instead, one order after the other, with nothing left out or repeated at an epoch's end
    (a global batch may span two epochs). The position after ``n`` positions is then
    ``divmod(epoch * len(dataset) + consumed + n, len(dataset))``.
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None,
                 rank: int | None = None, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.length = dataset if isinstance(dataset, int) else len(dataset)
        if self.length < 1:
            raise ValueError(f"the dataset has {self.length} samples; it needs at least one")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} of num_replicas {num_replicas}: need "
                             "num_replicas >= 1 and 0 <= rank < num_replicas")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, its order), the last one drawn

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Iterate over ``epoch`` from position ``consumed`` (positions all ranks consumed)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= consumed <= self.length:
            raise ValueError(f"consumed must be in 0..{self.length} (the dataset's length), "
                             f"got {consumed}; a position past the epoch's end belongs to a "
                             "later epoch: divmod(consumed, len(dataset)) gives both")
        self.epoch = epoch
        self.consumed = consumed

    def order(self, epoch: int) -> list[int]:
        """The global order of ``epoch``: every index of the dataset once."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(self.seed + epoch)
                indices = torch.randperm(self.length, generator=gen).tolist()
            else:
                indices = list(range(self.length))
            self._order = (epoch, indices)
        return self._order[1]

    def _rest(self) -> int:
        """How many positions from ``consumed`` on this epoch yields to all ranks together."""
        rest = self.length - self.consumed
        if self.drop_last:
            return rest - rest % self.num_replicas
        return -(-rest // self.num_replicas) * self.num_replicas

    def __len__(self) -> int:
        return self._rest() // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        end = self.consumed + self._rest()
        # Past the order's end (padding) the order starts over, as DistributedSampler pads.
        for pos in range(self.consumed + self.rank, end, self.num_replicas):
            yield order[pos % self.length]

    def stream(self, epoch: int | None = None, consumed: int | None = None) -> Iterator[int]:
        """This rank's share of the epochs from ``(epoch, consumed)`` on, without end.

        Defaults to the position ``set_epoch`` set. ``consumed`` may be past the epoch's end.
        """
        epoch = self.epoch if epoch is None else epoch
        consumed = self.consumed if consumed is None else consumed
        if epoch < 0 or consumed < 0:
            raise ValueError(f"epoch and consumed must be >= 0, got {epoch} and {consumed}")
        start = epoch * self.length + consumed + self.rank
        for pos in itertools.count(start, self.num_replicas):
            e, i = divmod(pos, self.length)
            yield self.order(e)[i]
