"""A store restarted after the workers' restore learns the current epoch from its ranks."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from snapshot_helpers import stage_segment

from ftrun.protocol import Message
from ftrun.snapshot import segment as shm
from ftrun.store.store import SnapshotStore, StoreConfig


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = f"ep{uuid.uuid4().hex[:10]}"
    yield rid
    for path in shm.list_segments(shm.job_prefix(rid)):
        path.unlink(missing_ok=True)


def new_store(run_id: str) -> SnapshotStore:
    return SnapshotStore(StoreConfig(run_id=run_id, url="ipc:///nonexistent", coordinator=None,
                                     node_id="host/1", owner_pid=os.getpid()), b"s" * 32)


def send(store: SnapshotStore, run_id: str, kind: str, **body: Any) -> dict[str, Any]:
    answer = store.handle(Message(kind, run_id, "test", time.time(), "id", body))
    assert answer is not None
    return answer[1]


def stage(store: SnapshotStore, run_id: str, rank: int, buffer: int, step: int, epoch: str,
          base: int) -> dict[str, Any]:
    shm.SHM_DIR.joinpath(shm.segment_name(run_id, rank, buffer)).unlink(missing_ok=True)
    seg = stage_segment(run_id, rank, buffer, {"w": torch.full((8,), float(step))}, step=step,
                        world_size=2, final_state=shm.STAGED)
    seg.set_state(shm.STAGED, epoch=epoch)
    seg.close()
    return send(store, run_id, "snap_staged", rank=rank, buffer=buffer, step=step, epoch=epoch,
                base=base)


def test_a_store_restarted_after_a_restore_follows_the_ranks_epoch(run_id: str) -> None:
    first = new_store(run_id)
    for rank in (0, 1):
        send(first, run_id, "snap_restored", rank=rank, epoch="e1", step=0, world_size=2)
    for rank in (0, 1):
        assert stage(first, run_id, rank, 0, 1, "e1", 0)["ok"]
    assert first.commits.committed == 1
    # The workers restart and restore step 1 in a new epoch; then the store is killed.
    for rank in (0, 1):
        send(first, run_id, "snap_restored", rank=rank, epoch="e2", step=1, world_size=2)
    del first

    second = new_store(run_id)
    second.adopt()
    assert second.commits.epoch == "e1"  # all its segments say so: a guess, and a wrong one
    # The ranks claim the other buffer for step 2 of e2: step 1 (e2's base) is committed.
    for rank in (0, 1):
        reply = send(second, run_id, "snap_claim", rank=rank, buffer=1, epoch="e2",
                     need_committed=1, base=1)
        assert reply["ok"], reply
    assert second.commits.epoch == "e2"
    for rank in (0, 1):
        assert stage(second, run_id, rank, 1, 2, "e2", 1)["ok"]
    assert second.commits.committed == 2  # and what follows commits
