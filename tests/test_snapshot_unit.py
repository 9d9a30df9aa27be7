"""Snapshot building blocks without processes: segments, manifests, commits, degraded mode."""

from __future__ import annotations

import logging
import random
import stat
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from snapshot_helpers import stage_segment

from ftrun.coordinator.commits import CommitTracker
from ftrun.errors import ConfigError, IntegrityError
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import (
    entries,
    flatten,
    manifest_blob,
    parse_manifest,
    tensor_view,
    unflatten,
)
from ftrun.snapshot.verify import check as verify_segment


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = f"unit-{uuid.uuid4().hex[:8]}"
    yield rid
    for path in shm.list_segments(shm.job_prefix(rid)):
        path.unlink(missing_ok=True)


def test_segment_is_private_and_round_trips(run_id: str) -> None:
    state = {"model": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int64)},
             "extra": {"pos": 17, "name": "x", 3: (1.5, None)}, "rng": random.getstate()}
    seg = stage_segment(run_id, 0, 0, state, step=7)
    assert stat.S_IMODE(seg.path.stat().st_mode) == 0o600
    again = shm.Segment.open(seg.name)
    h = again.header()
    assert (h.state, h.step) == (shm.VERIFIED, 7)
    assert verify_segment(again) == (True, "")
    doc = parse_manifest(again.manifest_bytes())
    data = again.data()
    tree = unflatten(doc, lambda _i, e: tensor_view(data, e).clone())
    assert torch.equal(tree["model"]["w"], state["model"]["w"])
    assert tree["extra"] == {"pos": 17, "name": "x", 3: (1.5, None)}
    assert tree["rng"] == state["rng"]
    again.close()
    seg.close()


def test_a_header_read_while_another_process_writes_it_is_whole(run_id: str) -> None:
    """The store and the rank write a segment's header while others read it: a reader never
    sees a half-written one (the GPU bench once read 'corrupt header (chunk size 0 ...)')."""
    seg = stage_segment(run_id, 0, 0, {"w": torch.zeros(64)}, step=1)
    writer = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from ftrun.snapshot import segment as shm
seg = shm.Segment.open({str(seg.path)!r})
h = seg.header()
print("ready", flush=True)
end = time.monotonic() + 1.5
step = 1
while time.monotonic() < end:
    step += 1
    h.step, h.state = step, (shm.STAGED, shm.VERIFIED)[step % 2]
    seg.write_header(h)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reads = 0
        while writer.poll() is None:
            h = seg.header()  # raised IntegrityError before write_header copied in one go
            assert h.chunk_size == shm.CHUNK_BYTES and h.data_len == seg.header().data_len
            reads += 1
        assert writer.returncode == 0 and reads > 100
    finally:
        writer.kill()
        writer.wait(timeout=10)
        seg.close()


def test_flipped_byte_is_detected(run_id: str) -> None:
    seg = stage_segment(run_id, 0, 0, {"model": {"w": torch.ones(1000)}}, step=3)
    h = seg.header()
    seg.mm[h.data_off + 10] ^= 0x01
    ok, reason = verify_segment(seg)
    assert not ok and "hash mismatch" in reason and "/model/w" in reason
    seg.mm[shm.HEADER_SIZE + 2] ^= 0x01  # the manifest too
    ok, reason = verify_segment(seg)
    assert not ok and "manifest hash mismatch" in reason
    seg.close()


def test_unsupported_values_are_refused_with_their_path() -> None:
    with pytest.raises(ConfigError, match=r"/extra/loader of type object"):
        flatten({"extra": {"loader": object()}})


def test_foreign_file_is_not_a_segment(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"x" * 8192)
    with pytest.raises(IntegrityError, match="bad magic"):
        shm.Segment.open(path)


def test_capacity_error_names_size_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 64 * 2**20)
    with pytest.raises(ConfigError) as exc:
        shm.check_capacity(3 * 2**30, "rank 0's snapshot buffers")
    msg = str(exc.value)
    assert "64 MiB free" in msg and "3072 MiB" in msg and "--shm-size" in msg


def test_leftovers_of_dead_owners_are_removed_and_live_ones_kept(run_id: str) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    other = f"{run_id}-dead"
    try:
        gone = stage_segment(other, 0, 0, {"w": torch.ones(4)}, step=1, owner_pid=dead.pid)
        live = stage_segment(run_id, 0, 0, {"w": torch.ones(4)}, step=1)
        # A segment of another ftrun release (its layout cannot be read here) is left alone,
        # whoever owns it: it may be a live job's on a shared host.
        foreign = stage_segment(f"{run_id}-v", 0, 0, {"w": torch.ones(4)}, step=1,
                                owner_pid=dead.pid)
        struct.pack_into("<I", foreign.mm, 8, shm.VERSION + 1)
        removed = shm.clean_leftovers()
        assert gone.name in removed and live.name not in removed
        assert live.path.exists() and not gone.path.exists()
        assert foreign.path.exists() and foreign.name not in removed
        foreign.unlink()
        gone.close()
        live.close()
    finally:
        for prefix in (other, f"{run_id}-v"):
            for path in shm.list_segments(shm.job_prefix(prefix)):
                path.unlink(missing_ok=True)


def test_commits_need_every_rank_and_stay_in_their_epoch() -> None:
    tracker = CommitTracker()
    tracker.begin("e1", base_step=4, world_size=2)
    tracker.verified("e1", 0, 5, 100)
    assert tracker.get("e1").committed == 4
    tracker.verified("e1", 1, 5, 100)
    assert tracker.get("e1").committed == 5
    # A new incarnation of the workers: shards of the old epoch do not count for it.
    tracker.begin("e2", base_step=5, world_size=2)
    tracker.verified("e1", 0, 6, 100)
    tracker.verified("e2", 1, 6, 100)
    assert tracker.get("e2").committed == 5
    tracker.verified("e2", 0, 6, 100)
    assert tracker.get("e2").committed == 6
    assert tracker.verified("nope", 0, 1, 1) is None
    assert tracker.summary()["committed_step"] == 6


def test_snapshotter_outside_ftrun_is_a_logged_no_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ftrun.rank import snapshotter
    from ftrun.rank.snapshotter import Snapshotter

    monkeypatch.delenv("FTRUN_STORE", raising=False)
    monkeypatch.setattr(snapshotter, "_SAID_OFF", False)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.WARNING):
        snap = Snapshotter(model, opt)
        Snapshotter(model, opt).close()  # said once per process
    assert caplog.text.count("snapshots are off") == 1
    # And by rank 0 only (RANK under torchrun): once per job, not once per rank.
    monkeypatch.setattr(snapshotter, "_SAID_OFF", False)
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Snapshotter(model, opt).close()
    assert "snapshots are off" not in caplog.text
    assert snap.restore(extra={"a": 1}) == 0 and snap.extra == {"a": 1}
    assert snap.save(1) is False
    snap.close()
    with pytest.raises(ConfigError, match="interval must be a number of steps >= 1"):
        Snapshotter(model, opt, every=0)


def test_entries_cover_the_data_region() -> None:
    flat = flatten({"a": torch.zeros(3), "b": torch.zeros(7, dtype=torch.float16)})
    doc = parse_manifest(manifest_blob(flat, step=1, rank=0, world_size=1, meta={}))
    ends = [e.offset + e.nbytes for e in entries(doc)]
    assert max(ends) <= flat.data_len
    assert all(e.offset % 64 == 0 for e in entries(doc))


def test_a_growing_manifest_keeps_its_buffers_until_it_outgrows_them(
        run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A framework's log history in ``extra`` grows the manifest a little each step: the
    buffers (and the newest snapshot in them) stay until the manifest no longer fits."""
    from ftrun.rank.context import RankContext
    from ftrun.rank.save import Saver

    monkeypatch.setenv("FTRUN_RUN_ID", run_id)
    ctx = RankContext()
    assert ctx.run_id == run_id
    saver = Saver(ctx, None, None, async_copy=False, wait_s=0.0)  # type: ignore[arg-type]
    try:
        saver.ensure_segments(40_000, 3, 4096)
        first = list(ctx.segments)
        assert all(seg is not None for seg in first)
        ctx.newest = (0, 7)
        for manifest_len in (40_001, 50_000, 79_999, 80_000):  # grows, still fits 2 x 40,000
            saver.ensure_segments(manifest_len, 3, 4096)
            assert ctx.segments == first and ctx.newest == (0, 7)
        saver.ensure_segments(80_001, 3, 4096)  # outgrown: new buffers, twice the room
        assert all(seg is not old for seg, old in zip(ctx.segments, first, strict=True))
        assert ctx.segments[0].header().manifest_cap == 160_002  # type: ignore[union-attr]
        assert ctx.newest is None  # the buffer that held it was re-created
    finally:
        saver.close()
        for seg in ctx.segments:
            if seg is not None:
                seg.close()
        ctx.close()


def test_a_claim_given_up_while_the_store_is_gone_ends_after_one_attempt(
        run_id: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A store that is down (killed, restarting) answers no claim. The training thread gives
    the save up at its next optimizer step; the copy thread must then stop asking within one
    attempt, or it stays busy (and an in-process restart waits for it) for the whole
    unreachable window."""
    from ftrun.rank import save
    from ftrun.rank.context import RankContext
    from ftrun.rank.save import SaveJob, Saver

    monkeypatch.setenv("FTRUN_RUN_ID", run_id)
    monkeypatch.setenv("FTRUN_STORE", f"ipc://{tmp_path}/nobody.sock")  # nothing listens
    monkeypatch.setattr(save, "CLAIM_ATTEMPT_S", 0.05)
    ctx = RankContext()
    ctx.connect()
    saver = Saver(ctx, None, None, async_copy=True, wait_s=0.0)  # type: ignore[arg-type]
    assert ctx.chan is not None
    sent = []
    encode = ctx.chan._encode

    def counting(*args: object, **kwargs: object) -> object:
        sent.append(args[0])
        job.give_up()  # the training thread moves on while this attempt waits
        return encode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ctx.chan, "_encode", counting)
    job = SaveJob(8)
    try:
        assert saver.claim(job, 1, 7) is None
        assert sent == ["snap_claim"], sent
        assert job.given_up and not job.started.is_set()
    finally:
        saver.close()
        ctx.close()
