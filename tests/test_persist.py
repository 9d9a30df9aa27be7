"""On-disk checkpoints: DCP layout, plain-DCP readability, integrity, completeness, pruning."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from snapshot_helpers import stage_segment, write_plain

from ftrun.coordinator.commits import FINAL_SETTLE_S, CommitTracker, StoreState
from ftrun.errors import ConfigError, IntegrityError, RestoreError
from ftrun.faults import corrupt_persisted
from ftrun.protocol import Message
from ftrun.rank import fallback
from ftrun.snapshot import persist, verify
from ftrun.snapshot import segment as shm
from ftrun.snapshot.api import PersistConfig
from ftrun.snapshot.manifest import flatten, parse_manifest
from ftrun.snapshot.segment import STAGED, VERIFIED, Segment, segment_name
from ftrun.store.api import StoreConfig
from ftrun.store.store import SnapshotStore

# -- helpers ----------------------------------------------------------------------------------


def make_state(seed: int = 0, step: int = 7) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "fc.weight": torch.randn(4, 3, generator=g),
            "fc.bias": torch.arange(4, dtype=torch.float64) + seed,
            "emb.weight": torch.randn(5, 2, generator=g).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 3),
        },
        "optim": {
            "state": {0: {"exp_avg": torch.full((4, 3), 0.5 + seed), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": {"torch": torch.arange(16, dtype=torch.uint8), "python": (3, (1, 2, 3), None),
                "numpy": np.arange(5, dtype=np.uint32) + seed},
        "extra": {"epoch": 2, "name": "demo", "blob": b"\x00\x01", "dtype": torch.float16},
        "step": step,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


SegmentFactory = Callable[..., Segment]


@pytest.fixture
def segments() -> Iterator[SegmentFactory]:
    run_id = f"tp{uuid.uuid4().hex[:10]}"
    made: list[Segment] = []

    def make(rank: int, state: Any, *, step: int, world_size: int = 1, buffer: int = 0,
             verified: bool = True) -> Segment:
        seg = stage_segment(run_id, rank, buffer, state, step=step, world_size=world_size,
                            final_state=VERIFIED if verified else STAGED)
        made.append(seg)
        return seg

    try:
        yield make
    finally:
        for seg in made:
            seg.unlink()


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ftrun-test-persist-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def persist_from(seg: Segment, root: Path) -> Path:
    doc = parse_manifest(seg.manifest_bytes())
    with seg.data() as data:
        return persist.write_rank(root, doc, data, verify.tensor_hashes(doc, data))


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_layout_plain_dcp_load_and_load_rank(segments: SegmentFactory, workdir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = make_state()
    seg = segments(0, state, step=12)
    out = persist_from(seg, workdir)
    assert out == workdir / "step_000000012" / "rank_00000"
    names = {p.name for p in out.iterdir()}
    assert {".metadata", persist.MANIFEST_FILE, persist.HASHES_FILE} <= names
    assert any(n.endswith(".distcp") for n in names)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    seg.mm.close()  # write_rank left no view into the segment behind

    # The keys are DCP's own flattening of {"model", "optim", "ftrun": {the rest}}: what
    # dcp.save of that state writes (numpy arrays, which DCP pickles, stored as tensors).
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    nested = {"model": state["model"], "optim": state["optim"],
              "ftrun": {k: v for k, v in state.items() if k not in ("model", "optim")}}
    written = dcp.FileSystemReader(str(out)).read_metadata()
    assert set(written.state_dict_metadata) == set(flatten_state_dict(nested)[0])
    assert "model.fc.weight" in written.state_dict_metadata
    assert written.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")

    # Plain DCP, knowing nothing of ftrun: the state's own structure, empty tensors in it.
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
             "optim": {"state": {0: {k: torch.zeros_like(v)
                                     for k, v in state["optim"]["state"][0].items()}},
                       "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]}}
    dcp.load(fresh, checkpoint_id=str(out), no_dist=True)
    assert_same(fresh, {"model": state["model"], "optim": state["optim"]})
    only_model = {"model": {"fc.weight": torch.zeros(4, 3)}}  # a part of the checkpoint
    dcp.load(only_model, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(only_model["model"]["fc.weight"], state["model"]["fc.weight"])
    rest = {"ftrun": {"step": 0, "extra": {"name": ""},
                      "rng": {"torch": torch.zeros(16, dtype=torch.uint8)}}}
    dcp.load(rest, checkpoint_id=str(out), no_dist=True)
    assert rest["ftrun"]["step"] == state["step"] and rest["ftrun"]["extra"]["name"] == "demo"
    assert torch.equal(rest["ftrun"]["rng"]["torch"], state["rng"]["torch"])

    tree = persist.load_rank(workdir, 12, 0)
    assert_same(tree, state)
    flat = flatten(state)
    hashes = json.loads((out / persist.HASHES_FILE).read_text())["tensors"]
    assert set(hashes) == {e.key for e in flat.tensors}


def test_write_rank_refuses_corrupt_bytes(segments: SegmentFactory, workdir: Path) -> None:
    seg = segments(0, make_state(), step=3)
    doc = parse_manifest(seg.manifest_bytes())
    with seg.data() as data:
        hashes = verify.tensor_hashes(doc, data)
    hashes[1] ^= 1
    with seg.data() as data, pytest.raises(IntegrityError, match="refusing to persist"):
        persist.write_rank(workdir, doc, data, hashes)
    assert not (workdir / "step_000000003" / "rank_00000").exists()
    assert not list(workdir.glob("step_*/.tmp-*"))


def test_write_rank_is_idempotent(workdir: Path) -> None:
    first = write_plain(workdir, make_state(), step=5)
    marker = first / "marker"
    marker.write_text("x")
    again = write_plain(workdir, make_state(seed=1), step=5)
    assert again == first and marker.exists()
    assert_same(persist.load_rank(workdir, 5, 0), make_state())


def test_corrupt_distcp_byte_is_detected(workdir: Path) -> None:
    state = make_state()
    out = write_plain(workdir, state, step=1)
    needle = state["optim"]["state"][0]["exp_avg"].numpy().tobytes()
    [distcp] = out.glob("*.distcp")
    raw = bytearray(distcp.read_bytes())
    at = raw.find(needle)
    assert at > 0
    raw[at + 7] ^= 0x40
    distcp.write_bytes(bytes(raw))

    with pytest.raises(IntegrityError) as info:
        persist.load_rank(workdir, 1, 0, verify=True)
    assert distcp.name in str(info.value) and "/optim/state/0/exp_avg" in str(info.value)
    persist.load_rank(workdir, 1, 0, verify=False)  # unchecked reads still go through
    [bad] = persist.verify_dir(out, batch_bytes=64)
    assert bad.key == "/optim/state/0/exp_avg" and bad.file.endswith(distcp.name)


def test_tmp_dirs_and_disagreeing_ranks_are_not_complete(workdir: Path) -> None:
    for rank in (0, 1):
        write_plain(workdir, make_state(rank), step=10, rank=rank, world_size=2)
    done = write_plain(workdir, make_state(), step=20, rank=0, world_size=2)
    # Rank 1 of step 20 died mid-write: a full-looking copy, but still under its temp name.
    shutil.copytree(done, done.parent / ".tmp-rank_00001-4242")
    # Step 30: both ranks present, but they disagree on the world size.
    write_plain(workdir, make_state(), step=30, rank=0, world_size=2)
    write_plain(workdir, make_state(), step=30, rank=1, world_size=3)
    # Step 40: a final-named directory without .metadata is corrupt, never complete.
    write_plain(workdir, make_state(), step=40, rank=0, world_size=1)
    (workdir / "step_000000040" / "rank_00000" / ".metadata").unlink()

    assert persist.complete_steps(workdir) == [(10, 2)]
    assert persist.latest_complete(workdir) == (10, 2)
    steps = {s.step: s for s in persist.list_steps(workdir)}
    assert [r.rank for r in steps[20].ranks] == [0] and len(steps[20].pending) == 1
    assert steps[40].problems and not steps[40].complete
    assert persist.latest_complete(workdir / "nothing-here") is None


def test_prune_keeps_newest_complete(workdir: Path) -> None:
    for step in (1, 2, 3, 4):
        write_plain(workdir, make_state(), step=step)
    write_plain(workdir, make_state(), step=5, rank=0, world_size=2)  # partial, newer
    stale = workdir / "step_000000004" / ".tmp-rank_00003-99"
    fresh = workdir / "step_000000005" / ".tmp-rank_00001-98"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 2 * persist.STALE_TMP_S
    os.utime(stale, (old, old))

    removed = persist.prune(workdir, keep=2)
    assert sorted(p.name for p in removed) == [".tmp-rank_00003-99", "step_000000001",
                                                "step_000000002"]
    assert sorted(p.name for p in workdir.iterdir()) == [
        "step_000000003", "step_000000004", "step_000000005"]
    assert fresh.exists()
    assert [s for s, _ in persist.complete_steps(workdir)] == [4, 3]
    assert persist.prune(workdir, keep=1) == [workdir / "step_000000003"]
    with pytest.raises(ConfigError, match="keep"):
        persist.prune(workdir, keep=0)


def test_to_torch_save_round_trip(workdir: Path) -> None:
    state = make_state(seed=3, step=99)
    out = write_plain(workdir, state, step=99)

    rank_file = persist.to_torch_save(out, workdir / "rank.pt")
    assert_same(torch.load(rank_file, weights_only=False), state)
    step_file = persist.to_torch_save(out.parent, workdir / "step.pt")
    assert_same(torch.load(step_file, weights_only=False), state)
    tensors_only = {"model": {"w": torch.ones(2)}, "step": 1}
    plain = write_plain(workdir, tensors_only, step=100)
    assert_same(torch.load(persist.to_torch_save(plain, workdir / "w.pt"), weights_only=True),
                tensors_only)
    with pytest.raises(ConfigError, match="neither"):
        persist.to_torch_save(workdir, workdir / "x.pt")

    # PyTorch's own converter (what `python -m ...format_utils dcp_to_torch` runs).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out, workdir / "flat.pt")
    nested = torch.load(workdir / "flat.pt", weights_only=True)
    assert_same(nested["model"], state["model"])
    assert_same(nested["optim"]["state"], {"0": state["optim"]["state"][0]})
    assert nested["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert nested["ftrun"]["extra"] == state["extra"] and nested["ftrun"]["step"] == 99


def test_colliding_keys_are_refused(workdir: Path) -> None:
    with pytest.raises(ConfigError, match="same checkpoint key"):
        write_plain(workdir, {"model": {1: torch.ones(1), "1": torch.zeros(1)}}, step=1)
    assert not list(workdir.glob("step_*/rank_*"))


# -- partial steps, epochs, pruning -----------------------------------------------------------


def test_prune_counts_complete_steps_and_drops_older_partial_ones(workdir: Path) -> None:
    for step in (10, 20, 30):
        for rank in (0, 1):
            write_plain(workdir, make_state(rank), step=step, rank=rank, world_size=2)
    for step in (5, 15, 25, 35):  # a node wrote its part, the other did not (yet)
        write_plain(workdir, make_state(), step=step, rank=0, world_size=2)
    steps = {s.step: s for s in persist.list_steps(workdir)}
    assert steps[15].why_incomplete.startswith("partial: rank(s) 1 of 2 missing")

    removed = persist.prune(workdir, keep=2)
    # Partial steps older than the newest complete one can never complete: gone. The
    # partial step newer than it may still be being written: kept. keep counts complete only.
    assert sorted(p.name for p in removed) == [
        "step_000000005", "step_000000010", "step_000000015", "step_000000025"]
    assert sorted(p.name for p in workdir.iterdir()) == [
        "step_000000020", "step_000000030", "step_000000035"]
    assert persist.prune(workdir, keep=2) == []
    assert persist.prune(workdir, keep=1) == [workdir / "step_000000020"]
    assert [s for s, _ in persist.complete_steps(workdir)] == [30]


def test_a_step_never_mixes_ranks_of_two_epochs(workdir: Path) -> None:
    # Epoch "old" wrote rank 0 of step 8 before its job died; after a restore from an older
    # step, epoch "new" reaches step 8 again with other values.
    write_plain(workdir, make_state(0), step=8, rank=0, world_size=2, meta={"epoch": "old"})
    write_plain(workdir, make_state(1), step=8, rank=1, world_size=2, meta={"epoch": "new"})
    [step8] = persist.list_steps(workdir)
    assert not step8.complete and "different incarnations" in step8.why_incomplete

    # The new epoch's rank 0 replaces the stale one (same epoch: left as it is).
    write_plain(workdir, make_state(2), step=8, rank=0, world_size=2, meta={"epoch": "new"})
    assert persist.complete_steps(workdir) == [(8, 2)]
    assert_same(persist.load_rank(workdir, 8, 0)["model"], make_state(2)["model"])
    write_plain(workdir, make_state(3), step=8, rank=0, world_size=2, meta={"epoch": "new"})
    assert_same(persist.load_rank(workdir, 8, 0)["model"], make_state(2)["model"])
    assert not [p for p in workdir.iterdir() if p.name.startswith(persist.TRASH_PREFIX)]


# -- persist targets (the coordinator's choice of step) ---------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _commit(tracker: CommitTracker, epoch: str, step: int, world: int = 2) -> None:
    for rank in range(world):
        tracker.verified(epoch, rank, step, 10)


def _targets(tracker: CommitTracker) -> list[tuple[int, str, bool]]:
    out = [(t.step, t.reason, t.final) for t in tracker.new_targets]
    tracker.new_targets.clear()
    return out


def test_targets_every_n_steps_from_the_base_and_across_restarts() -> None:
    tracker = CommitTracker(clock=FakeClock())
    tracker.handle("snap_epoch", {"node_id": "a", "epoch": "e1", "base_step": 262,
                                  "world_size": 2, "persist_every": 50})
    for step in range(263, 306):
        _commit(tracker, "e1", step)
    assert _targets(tracker) == [(300, "every 50 steps", False)]
    reply, _ = tracker.handle("commit_query", {"epoch": "e1"})
    assert reply["committed"] == 305 and reply["targets"] == [300] and reply["final"] is None
    # A restart from memory at 305: the schedule goes on, nothing is written twice.
    tracker.begin("e2", 305, 2)
    for step in range(306, 351):
        _commit(tracker, "e2", step)
    assert _targets(tracker) == [(350, "every 50 steps", False)]


def test_targets_by_interval_signal_and_one_final() -> None:
    clock = FakeClock()
    tracker = CommitTracker(clock=clock)
    tracker.handle("snap_epoch", {"node_id": "a", "epoch": "e", "base_step": 0,
                                  "world_size": 2, "persist_interval_s": 2.0})
    _commit(tracker, "e", 1)
    clock.now += 2.5
    _commit(tracker, "e", 2)
    _commit(tracker, "e", 3)
    assert _targets(tracker) == [(2, "interval 2 s", False)]
    # SIGUSR1 reaches both stores: one target, the committed step.
    for node in ("a", "b"):
        reply, _ = tracker.handle("persist_request", {"node_id": node, "epoch": "e",
                                                      "reason": "SIGUSR1", "final": False})
    assert _targets(tracker) == [(3, "SIGUSR1", False)] and reply["targets"] == [2, 3]
    # The end: rank 0 verified step 4, rank 1 not yet: the final target waits (bounded) for it.
    tracker.verified("e", 0, 4, 10)
    reply, _ = tracker.handle("persist_request", {"node_id": "a", "epoch": "e",
                                                  "reason": "end of job", "final": True})
    assert reply.get("settling") and reply["final"] is None
    tracker.verified("e", 1, 4, 10)
    reply, _ = tracker.handle("persist_request", {"node_id": "a", "epoch": "e",
                                                  "reason": "end of job", "final": True})
    assert reply["final"] == 4 and not reply.get("settling")
    reply, _ = tracker.handle("persist_request", {"node_id": "b", "epoch": "e",
                                                  "reason": "end of job", "final": True})
    assert reply["final"] == 4
    assert _targets(tracker) == [(4, "end of job", True)]
    # Nothing is scheduled after the final target; a step that never completes does not
    # hold the final target up for longer than the settle time.
    clock.now += 10
    _commit(tracker, "e", 5)
    assert _targets(tracker) == []
    tracker.begin("f", 5, 2)
    tracker.verified("f", 0, 6, 10)
    reply, _ = tracker.handle("persist_request", {"node_id": "a", "epoch": "f",
                                                  "reason": "end of job", "final": True})
    assert reply.get("settling")
    clock.now += FINAL_SETTLE_S
    reply, _ = tracker.handle("persist_request", {"node_id": "a", "epoch": "f",
                                                  "reason": "end of job", "final": True})
    assert reply["final"] == 5


def test_no_new_target_while_a_node_still_writes() -> None:
    tracker = CommitTracker(clock=FakeClock())
    tracker.handle("snap_epoch", {"node_id": "a", "epoch": "e", "base_step": 0,
                                  "world_size": 2, "persist_every": 1})
    tracker.stores["a"] = StoreState(True, "e", -1, None)
    tracker.stores["b"] = StoreState(True, "e", -1, None)
    tracker.stores["spare"] = StoreState(True, None, -1, None)  # no part in the epoch
    _commit(tracker, "e", 1)
    assert _targets(tracker) == [(1, "every 1 steps", False)]
    tracker.stores["a"] = StoreState(True, "e", 1, None)
    tracker.stores["b"] = StoreState(True, "e", 1, 1)  # still writing step 1
    _commit(tracker, "e", 2)
    assert _targets(tracker) == [] and tracker.skipped == [(2, ["b"])]
    tracker.stores["b"] = StoreState(True, "e", 1, None)
    _commit(tracker, "e", 3)
    assert _targets(tracker) == [(3, "every 1 steps", False)]


# -- restore from disk (collective; two ranks as threads) -------------------------------------


def restore_as(world: int, root: Path, start_fresh: bool = False,
               live: Callable[[int], dict[str, Any]] | None = None) -> list[Any]:
    """Run fallback.restore_from_disk on ``world`` ranks at once; results or exceptions."""
    barrier = threading.Barrier(world, timeout=60)
    slots: list[Any] = [None] * world

    def rank(r: int) -> Any:
        def gather(obj: Any) -> list[Any]:
            slots[r] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        try:
            return fallback.restore_from_disk(
                str(root), rank=r, world_size=world, gather=gather, start_fresh=start_fresh,
                live_state=None if live is None else lambda: live(r))
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


def write_step(root: Path, step: int, world: int = 2, ranks: tuple[int, ...] | None = None) -> None:
    for r in ranks if ranks is not None else range(world):
        write_plain(root, make_state(r, step), step=step, rank=r, world_size=world,
                    meta={"epoch": "e"})


def test_restore_skips_partial_and_corrupt_steps_on_any_rank(
        workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_step(workdir, 4)
    write_step(workdir, 6)
    write_step(workdir, 8)
    write_step(workdir, 10, ranks=(0,))  # newest: partial
    corrupt_persisted(str(workdir), 8, 1)  # rank 1's shard of step 8 has a flipped byte
    with caplog.at_level(logging.WARNING, logger="ftrun"):
        results = restore_as(2, workdir)
    assert [r.step for r in results] == [6, 6]  # both ranks, the same older step
    assert_same(results[1].tree, make_state(1, 6))
    assert [str(f) for f in results[0].refused][0].startswith("step 10: partial: rank(s) 1 of 2")
    assert "step 8: fails verification on rank 1: " in str(results[0].refused[1])
    logged = caplog.text
    assert "persisted step 10 in" in logged and "is skipped: partial" in logged
    assert "persisted step 8 in" in logged and "fails verification on rank(s) 1" in logged


def test_restore_refuses_to_start_fresh_silently(workdir: Path) -> None:
    assert [r.step for r in restore_as(2, workdir / "missing")] == [0, 0]
    write_step(workdir, 3)
    write_step(workdir, 5, ranks=(1,))
    corrupt_persisted(str(workdir), 3, 0)
    (workdir / "step_000000003" / "rank_00001" / persist.HASHES_FILE).unlink()
    errors = restore_as(2, workdir)
    assert all(isinstance(e, RestoreError) for e in errors), errors
    message = str(errors[0])
    assert f"--persist-dir {workdir} holds 2 persisted step(s), but none can be restored" in message
    assert "step 5: partial: rank(s) 0 of 2 missing" in message
    assert "step 3: fails verification on rank 0: " in message and "rank 1: " in message
    assert "--start-fresh" in message and "FTRUN_START_FRESH=1" in message
    fresh = restore_as(2, workdir, start_fresh=True)
    assert [r.step for r in fresh] == [0, 0] and len(fresh[0].refused) == 2
    assert sorted(p.name for p in workdir.iterdir()) == ["step_000000003", "step_000000005"]


# -- the store without a coordinator: targets are copied before a claim lets them go ----------


def test_store_persists_each_target_before_its_buffer_is_reused(workdir: Path) -> None:
    run_id = f"tp{uuid.uuid4().hex[:10]}"
    cfg = StoreConfig(run_id=run_id, url="ipc:///nonexistent", coordinator=None,
                      node_id="host/1", owner_pid=os.getpid(),
                      persist=PersistConfig(dir=str(workdir), every=2, keep=10))
    store = SnapshotStore(cfg, b"s" * 32)

    def send(kind: str, **body: Any) -> dict[str, Any]:
        msg = Message(kind, run_id, "test", time.time(), "id", body)
        answer = store.handle(msg)
        assert answer is not None
        return answer[1]

    def save(step: int) -> None:
        buffer = step % 2
        for rank in (0, 1):
            if step > 2:  # the buffer held step - 2: the rank must be allowed to reuse it
                assert send("snap_claim", rank=rank, buffer=buffer, epoch="e1",
                            need_committed=step - 1)["ok"]
            shm.SHM_DIR.joinpath(segment_name(run_id, rank, buffer)).unlink(missing_ok=True)
            seg = stage_segment(run_id, rank, buffer, make_state(rank, step), step=step,
                                world_size=2, final_state=STAGED)
            seg.set_state(STAGED, epoch="e1")  # as a rank's save() does
            seg.close()
            assert send("snap_staged", rank=rank, buffer=buffer, step=step, epoch="e1")["ok"]
        if store.persister.pending_write is not None:  # a training step longer than a write
            store.persister.pending_write.result(timeout=120)

    try:
        for rank in (0, 1):
            send("snap_restored", rank=rank, epoch="e1", step=0, world_size=2)
        for step in range(1, 6):
            save(step)
        assert store.commits.committed == 5
        # Steps 2 and 4 were due; each was copied before step+2 overwrote its buffer.
        assert [s for s, _ in persist.complete_steps(workdir)] == [4, 2]
        store._persist_final()  # what SIGTERM or the end of the job does
        assert [s for s, _ in persist.complete_steps(workdir)] == [5, 4, 2]
        assert_same(persist.load_rank(workdir, 2, 1), make_state(1, 2))
        assert_same(persist.load_rank(workdir, 4, 1), make_state(1, 4))
    finally:
        store.persister.writer.shutdown(wait=True)
        for path in shm.list_segments(shm.job_prefix(run_id)):
            path.unlink(missing_ok=True)


# -- one DCP checkpoint per step, restored onto other world sizes -----------------------------

FULL = torch.arange(24, dtype=torch.float32).reshape(8, 3)


def write_sharded(root: Path, step: int, world: int = 2, *,
                  ranks: tuple[int, ...] | None = None) -> None:
    """``model/w`` and its ``exp_avg`` row-sharded as FSDP2 shards them; ``model/b`` and the
    optimizer's ``step`` replicated; RNG state and ``extra`` per rank."""
    rows = FULL.shape[0] // world
    for r in ranks if ranks is not None else range(world):
        state = {
            "model": {"w": FULL[r * rows:(r + 1) * rows].clone(), "b": torch.ones(3)},
            "optim": {"state": {"w": {"step": torch.tensor(5.0),
                                      "exp_avg": FULL[r * rows:(r + 1) * rows] / 10}},
                      "param_groups": [{"lr": 0.5, "params": ["w"]}]},
            "rng": {"torch": torch.tensor([r], dtype=torch.int64)},
            "extra": {"rank": r},
            "step": step,
        }
        shard = {"global_shape": list(FULL.shape), "offsets": [r * rows, 0],
                 "placements": ["S(0)"], "mesh": [world]}
        write_plain(root, state, step=step, rank=r, world_size=world, meta={"epoch": "e"},
                    layout={"/model/w": shard, "/optim/state/w/exp_avg": shard})


def live_plain(_rank: int) -> dict[str, Any]:
    """A live state of plain (unsharded) tensors, to be loaded into."""
    return {"model": {"w": torch.zeros(8, 3), "b": torch.zeros(3)},
            "optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(8, 3)}},
                      "param_groups": [{"lr": 0.1, "params": ["w"]}]}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_dcp_checkpoint_per_step_merged_when_the_last_rank_lands(workdir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    write_sharded(workdir, 6, ranks=(1,))
    [partial] = persist.list_steps(workdir)
    assert not partial.merged and partial.why_incomplete.startswith("partial: rank(s) 0 of 2")
    write_sharded(workdir, 6, ranks=(0,))  # the last part: its writer merges .metadata
    [step] = persist.list_steps(workdir)
    assert step.merged and step.complete, step.why_incomplete
    layout = persist.step_layout(step)
    w = layout.metadata.state_dict_metadata["model.w"]
    assert tuple(w.size) == (8, 3)
    assert sorted(tuple(c.offsets) for c in w.chunks) == [(0, 0), (4, 0)]
    assert len(layout.metadata.state_dict_metadata["model.b"].chunks) == 1  # taken once
    # Differ between ranks: no global form, in the rank directories only.
    assert layout.rank_local == ["ftrun.extra.rank", "ftrun.rng.torch"]

    # Plain torch.distributed.checkpoint reads the global tensors and the shared values.
    whole = {"model": {"w": torch.zeros(8, 3)},
             "optim": {"state": {"w": {"exp_avg": torch.zeros(8, 3)}},
                       "param_groups": [{"lr": 0.0, "params": []}]},
             "ftrun": {"step": 0}}
    dcp.load(whole, checkpoint_id=step.path, no_dist=True)
    assert torch.equal(whole["model"]["w"], FULL)
    assert torch.equal(whole["optim"]["state"]["w"]["exp_avg"], FULL / 10)
    assert whole["optim"]["param_groups"] == [{"lr": 0.5, "params": ["w"]}]
    assert whole["ftrun"]["step"] == 6
    dcp_to_torch_save(step.path, workdir / "flat.pt")
    assert torch.equal(torch.load(workdir / "flat.pt", weights_only=True)["model"]["w"], FULL)
    # Each rank directory still loads as that rank's own shard.
    assert torch.equal(persist.load_rank(workdir, 6, 1)["model"]["w"], FULL[4:])

    # A .metadata that does not describe the rank directories beside it is never trusted.
    write_sharded(workdir, 7, world=4)
    shutil.copy(persist.step_dir(workdir, 7) / ".metadata", step.path / ".metadata")
    with pytest.raises(IntegrityError, match="does not describe the rank directories"):
        persist.step_layout(persist.read_step_dir(step.path))


def test_restore_reshards_a_step_onto_another_world_size(
        workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_sharded(workdir, 4, world=4)
    with caplog.at_level(logging.WARNING, logger="ftrun"):
        results = restore_as(3, workdir, live=live_plain)
    assert [r.step for r in results] == [4, 4, 4] and results[0].world_size == 4
    for r, found in enumerate(results):
        assert torch.equal(found.tree["model"]["w"], FULL)
        assert torch.equal(found.tree["optim"]["state"]["w"]["exp_avg"], FULL / 10)
        assert float(found.tree["optim"]["state"]["w"]["step"]) == 5.0
        assert found.tree["optim"]["param_groups"][0]["lr"] == 0.5  # the step's, not live's
        assert found.tree["extra"] == {"rank": r % 4}  # per-rank state: old rank r % N
        assert int(found.tree["rng"]["torch"][0]) == r % 4
    assert "written by 4 ranks, this job has 3" in caplog.text

    # A flipped byte in a shard that only another rank loads is still caught.
    corrupt_persisted(str(workdir), 4, 3)
    errors = restore_as(3, workdir, live=live_plain)
    assert isinstance(errors[0], RestoreError), errors
    assert "step 4: cannot be resharded on rank 0: " in str(errors[0])


def test_restore_onto_another_world_size_refuses_what_it_cannot_reshard(workdir: Path) -> None:
    write_sharded(workdir, 2)
    errors = restore_as(1, workdir)  # no live state to reshard into
    assert isinstance(errors[0], RestoreError), errors
    message = str(errors[0])
    assert ("step 2: cannot be resharded on rank 0: it was written by 2 ranks and this job "
            "has 1") in message
    assert "This job has 1 rank(s); 2-rank step(s) restore as they are when relaunched" in message
    assert "--start-fresh" in message

    # A plain model tensor that differs between the ranks has no global form.
    for r in (0, 1):
        write_plain(workdir, {"model": {"w": torch.full((2,), float(r))}}, step=3, rank=r,
                    world_size=2, meta={"epoch": "e"})
    errors = restore_as(1, workdir, live=lambda _r: {"model": {"w": torch.zeros(2)}})
    assert isinstance(errors[0], RestoreError), errors
    assert "tensor model.w is not one global tensor in the step" in str(errors[0])


def test_a_step_of_the_first_layout_reads_and_restores_on_its_world_size(workdir: Path) -> None:
    """tests/fixtures/persist_v1: a 2-rank FSDP2 step written by an ftrun of the first layout
    (keys "model/0.weight"), read by its hashes file's version."""
    from fsdp_worker import _xxh3

    shutil.copytree(Path(__file__).with_name("fixtures") / "persist_v1", workdir / "ckpt",
                    ignore=shutil.ignore_patterns("README.md"))
    root = workdir / "ckpt"
    [step] = persist.list_steps(root)
    assert step.complete and persist.step_layout(step).keys == persist.LAYOUT_FLAT
    assert all(persist.verify_dir(r.path) == [] for r in step.ranks)
    results = restore_as(2, root)
    assert [r.step for r in results] == [3, 3] and not results[0].refused
    # Each rank gets its own rows back: together, the weights the job had at step 3.
    model = {k: torch.cat([r.tree["model"][k] for r in results]) for k in results[0].tree["model"]}
    assert _xxh3(model) == "9f3ab9abb5ed0fe6"
    assert results[1].tree["step"] == 3 and results[1].tree["optim"]["param_groups"][0]["lr"] == 0.01
