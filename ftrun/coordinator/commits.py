"""Global snapshot commits: step S is committed once every rank's shard of S is verified.

Commits are counted per *epoch*. Every (re)start of the workers begins a new epoch at
``restore()``, where all ranks agree on one epoch id and the step they resumed from (its
``base_step``, committed by definition). Counting per epoch keeps shards verified by a
previous incarnation of the workers from completing a step that the current one has not
written yet. Everything here can be rebuilt from the stores: they report again after a
coordinator restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_PENDING_STEPS = 64  # steps tracked per epoch; older incomplete ones are dropped


@dataclass
class Epoch:
    epoch: str
    base_step: int
    world_size: int
    created_at: float
    committed: int
    committed_at: float
    verified: dict[int, set[int]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its last shard


class CommitTracker:
    def __init__(self, max_epochs: int = 16) -> None:
        self._epochs: dict[str, Epoch] = {}
        self._order: list[str] = []
        self._max_epochs = max_epochs
        self.persisted: dict[str, int | None] = {}  # node -> newest persisted step

    def begin(self, epoch: str, base_step: int, world_size: int) -> Epoch:
        ep = self._epochs.get(epoch)
        if ep is None:
            now = time.time()
            ep = Epoch(epoch, base_step, world_size, now, base_step, now)
            self._epochs[epoch] = ep
            self._order.append(epoch)
            while len(self._order) > self._max_epochs:
                self._epochs.pop(self._order.pop(0), None)
        return ep

    def verified(self, epoch: str, rank: int, step: int, nbytes: int) -> Epoch | None:
        """Record a verified shard; returns the epoch (None if unknown)."""
        ep = self._epochs.get(epoch)
        if ep is None:
            return None
        ep.nbytes[rank] = nbytes
        if step <= ep.committed:
            return ep
        ranks = ep.verified.setdefault(step, set())
        ranks.add(rank)
        if len(ranks) >= ep.world_size:
            ep.committed, ep.committed_at = step, time.time()
            for old in [s for s in ep.verified if s <= step]:
                del ep.verified[old]
        while len(ep.verified) > MAX_PENDING_STEPS:
            del ep.verified[min(ep.verified)]
        return ep

    def get(self, epoch: str) -> Epoch | None:
        return self._epochs.get(epoch)

    def latest(self) -> Epoch | None:
        return self._epochs[self._order[-1]] if self._order else None

    def summary(self) -> dict[str, object] | None:
        ep = self.latest()
        if ep is None:
            return None
        persisted = [s for s in self.persisted.values() if s is not None]
        return {
            "epoch": ep.epoch,
            "world_size": ep.world_size,
            "base_step": ep.base_step,
            "committed_step": ep.committed if ep.committed > 0 else None,
            "committed_age_s": round(time.time() - ep.committed_at, 3) if ep.committed > 0 else None,
            "pending_steps": sorted(ep.verified),
            "bytes_per_rank": {str(r): b for r, b in sorted(ep.nbytes.items())},
            "persisted_step": min(persisted) if persisted else None,
        }
