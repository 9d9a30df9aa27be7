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


def test_a_restarted_store_reports_again_what_its_predecessor_verified(run_id: str) -> None:
    """The store is killed between marking a rank's shard VERIFIED and its report reaching the
    coordinator (which outlives it). Its successor adopts the shard: unless it reports it
    again, the step never commits and every later claim of the job's ranks is refused."""
    first = new_store(run_id)
    for rank in (0, 1):
        send(first, run_id, "snap_restored", rank=rank, epoch="e1", step=0, world_size=2)
    for rank in (0, 1):
        assert stage(first, run_id, rank, 0, 1, "e1", 0)["ok"]
    assert stage(first, run_id, 0, 1, 2, "e1", 0)["ok"]
    # Rank 1's step 2: staged and verified by the first store, which died before reporting.
    shm.SHM_DIR.joinpath(shm.segment_name(run_id, 1, 1)).unlink(missing_ok=True)
    seg = stage_segment(run_id, 1, 1, {"w": torch.full((8,), 2.0)}, step=2, world_size=2,
                        final_state=shm.VERIFIED)
    seg.set_state(shm.VERIFIED, epoch="e1")
    seg.close()
    coordinator = first.commits._local  # the job's commit tracker, which outlives the store
    assert coordinator is not None and coordinator.get("e1").committed == 1
    del first

    second = new_store(run_id)
    second.commits._local = coordinator
    second.adopt()
    assert coordinator.get("e1").committed == 2
    reply = send(second, run_id, "snap_claim", rank=0, buffer=0, epoch="e1", need_committed=2,
                 base=0)
    assert reply["ok"] and reply["committed"] == 2, reply


def test_a_verified_report_the_coordinator_left_unanswered_is_sent_again(
        run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the coordinator answers nothing (two requests unanswered: the store asks it
    nothing for a while), a rank's shard is verified. Its report goes once the coordinator
    is asked again; dropped, the step would never commit and every later claim be refused."""
    from conftest import wait_for

    from ftrun.coordinator.server import Coordinator
    from ftrun.store import commits as store_commits

    monkeypatch.setattr(store_commits, "COORDINATOR_QUIET_S", 0.3)
    secret = b"s" * 32
    coordinator = Coordinator(run_id, secret, bind_host="127.0.0.1")
    coordinator.start()
    try:
        store = SnapshotStore(StoreConfig(run_id=run_id, url="ipc:///nonexistent",
                                          coordinator=coordinator.endpoint, node_id="host/1",
                                          owner_pid=os.getpid()), secret)
        for rank in (0, 1):
            send(store, run_id, "snap_restored", rank=rank, epoch="e1", step=0, world_size=2)
        for rank in (0, 1):
            assert stage(store, run_id, rank, 0, 1, "e1", 0)["ok"]
        assert store.commits.committed == 1
        assert stage(store, run_id, 0, 1, 2, "e1", 0)["ok"]
        for _ in range(store_commits.COORDINATOR_QUIET_AFTER):
            store.commits.coordinator_unanswered()
        assert store.commits.coordinator_quiet()
        assert stage(store, run_id, 1, 1, 2, "e1", 0)["ok"]  # verified, its report not sent
        assert store.commits.committed == 1
        wait_for(lambda: not store.commits.coordinator_quiet(), 10, "the quiet spell to end")
        store._poll()  # the store's loop, a second later
        assert store.commits.committed == 2
        reply = send(store, run_id, "snap_claim", rank=0, buffer=0, epoch="e1",
                     need_committed=2, base=0)
        assert reply["ok"], reply
    finally:
        coordinator.stop()
