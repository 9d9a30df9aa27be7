"""Ranks skip snapshots independently (they never wait for the store); a step that one rank
skipped or that failed verification is *dead*, and never holds anyone's buffers."""

from __future__ import annotations

import torch
from snapshot_helpers import stage_segment
from test_store_epoch import new_store, run_id, send, stage  # noqa: F401 (fixture)

from ftrun.coordinator.commits import CommitTracker
from ftrun.snapshot import segment as shm


def test_a_step_passed_over_by_one_rank_is_dead_and_the_next_commits() -> None:
    tracker = CommitTracker()
    tracker.begin("e", base_step=0, world_size=3)
    for rank in (0, 1, 2):
        tracker.verified("e", rank, 1, 10)
    tracker.verified("e", 0, 2, 10)
    tracker.verified("e", 1, 2, 10)
    ep = tracker.get("e")
    assert ep.committed == 1 and ep.live_dead() == [] and ep.pending() == {2: 2}
    tracker.verified("e", 2, 3, 10)  # rank 2 skipped step 2
    assert ep.live_dead() == [2] and ep.pending() == {3: 1}
    reply, _ = tracker.handle("commit_query", {"epoch": "e"})
    assert reply["dead"] == [2]
    # A rank verifying a step another rank already went past without it: dead at once.
    tracker.verified("e", 0, 4, 10)
    tracker.verified("e", 1, 3, 10)
    assert ep.live_dead() == [2, 3]
    for rank in (1, 2):
        tracker.verified("e", rank, 4, 10)
    assert ep.committed == 4 and ep.live_dead() == []
    assert tracker.summary()["dead_steps"] == []


def test_a_shard_that_failed_verification_kills_its_step() -> None:
    tracker = CommitTracker()
    tracker.begin("e", base_step=5, world_size=2)
    tracker.verified("e", 0, 6, 10)
    reply, _ = tracker.handle("snap_verified", {"node_id": "n", "epoch": "e", "rank": 1,
                                                "step": 6, "nbytes": 10, "ok": False})
    assert reply["dead"] == [6] and reply["committed"] == 5
    tracker.verified("e", 1, 6, 10)  # a late report of the same shard changes nothing
    assert tracker.get("e").committed == 5


def test_a_rank_whose_newest_step_is_dead_overwrites_it_and_keeps_the_committed_one(
        run_id: str) -> None:  # noqa: F811 (fixture)
    store = new_store(run_id)
    for rank in (0, 1):
        send(store, run_id, "snap_restored", rank=rank, epoch="e", step=0, world_size=2)
        assert stage(store, run_id, rank, 0, 1, "e", 0)["ok"]
    assert store.commits.committed == 1
    # Rank 0 snapshots step 2; rank 1 gave step 2 up (its buffer came too late) and takes 3.
    assert send(store, run_id, "snap_claim", rank=0, buffer=1, epoch="e", need_committed=1,
                base=0)["ok"]
    assert stage(store, run_id, 0, 1, 2, "e", 0)["ok"]
    reply = send(store, run_id, "snap_claim", rank=1, buffer=1, epoch="e", need_committed=1,
                 base=0)
    assert reply["ok"] and "buffer" not in reply
    assert stage(store, run_id, 1, 1, 3, "e", 0)["ok"]
    # Step 2 can never commit: rank 0 is told to overwrite it (buffer 1), not step 1.
    reply = send(store, run_id, "snap_claim", rank=0, buffer=0, epoch="e", need_committed=2,
                 base=0)
    assert reply == {"ok": True, "committed": 1, "buffer": 1}
    held = shm.Segment.open(shm.segment_name(run_id, 0, 0))
    assert held.header().step == 1 and held.header().state == shm.VERIFIED
    held.close()
    assert stage(store, run_id, 0, 1, 3, "e", 0)["ok"]
    assert store.commits.committed == 3


def test_a_corrupt_staged_shard_frees_the_other_ranks_buffers(run_id: str) -> None:  # noqa: F811
    store = new_store(run_id)
    for rank in (0, 1):
        send(store, run_id, "snap_restored", rank=rank, epoch="e", step=0, world_size=2)
        assert stage(store, run_id, rank, 0, 1, "e", 0)["ok"]
    assert stage(store, run_id, 0, 1, 2, "e", 0)["ok"]
    # Rank 1's step 2 arrives with a manifest that does not match its checksum.
    name = shm.segment_name(run_id, 1, 1)
    shm.SHM_DIR.joinpath(name).unlink(missing_ok=True)
    seg = stage_segment(run_id, 1, 1, {"w": torch.zeros(8)}, step=2, world_size=2,
                        final_state=shm.STAGED)
    seg.set_state(shm.STAGED, epoch="e", manifest_xxh3=seg.header().manifest_xxh3 ^ 1)
    seg.close()
    done = send(store, run_id, "snap_staged", rank=1, buffer=1, step=2, epoch="e", base=0)
    assert not done["ok"], done
    assert "manifest hash mismatch" in done["reason"]
    for rank in (0, 1):
        reply = send(store, run_id, "snap_claim", rank=rank, buffer=0, epoch="e",
                     need_committed=2, base=0)
        assert reply["ok"] and reply["buffer"] == 1, reply


def test_a_buffer_being_copied_for_the_disk_is_not_released(run_id: str) -> None:  # noqa: F811
    store = new_store(run_id)
    for rank in (0, 1):
        send(store, run_id, "snap_restored", rank=rank, epoch="e", step=0, world_size=2)
        assert stage(store, run_id, rank, 0, 1, "e", 0)["ok"]
        assert stage(store, run_id, rank, 1, 2, "e", 0)["ok"]
    names, problem = store.persister.locate_step(1)
    assert problem == "" and len(names) == 2
    store.persister.pinned.update(names)  # what persist_target does until the writer copied them
    reply = send(store, run_id, "snap_claim", rank=0, buffer=0, epoch="e", need_committed=2,
                 base=0)
    assert reply == {"ok": False, "committed": 2}
    shards, problem = store.persister.copy_shards(1, names)
    assert problem == "" and [doc["rank"] for doc, *_ in shards] == [0, 1]
    assert send(store, run_id, "snap_claim", rank=0, buffer=0, epoch="e", need_committed=2,
                base=0)["ok"]
