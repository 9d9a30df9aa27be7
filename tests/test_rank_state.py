"""What a snapshot captures in the rank: stateful objects and RNG states (no store needed)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ftrun.errors import ConfigError
from ftrun.rank import rng
from ftrun.rank import snapshotter as client
from ftrun.rank.state import check_stateful
from ftrun.snapshot.manifest import flatten, manifest_blob, parse_manifest, tensor_view, unflatten


def roundtrip(tree: object) -> object:
    """Through the manifest and a data buffer, as a snapshot travels."""
    flat = flatten(tree)
    doc = parse_manifest(manifest_blob(flat, step=1, rank=0, world_size=1, meta={}))
    data = memoryview(bytearray(flat.data_len))
    for entry, src in zip(flat.tensors, flat.sources, strict=True):
        if entry.nbytes:
            tensor_view(data, entry).copy_(src)
    return unflatten(doc, lambda _i, e: tensor_view(data, e).clone())


def draws() -> tuple[float, float, float, float]:
    return (torch.rand(()).item(), random.random(), random.gauss(0, 1),
            float(np.random.standard_normal()))


def test_rng_states_roundtrip_and_restore_every_generator() -> None:
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and in numpy's
    state = roundtrip(rng.rng_state())
    expected = draws()
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    rng.set_rng_state(state)  # type: ignore[arg-type]
    assert draws() == expected


def test_rng_state_tensors_are_refreshed_in_place() -> None:
    state = rng.rng_state()
    ref = state["torch"]
    draws()
    rng.refresh_rng_state(state)
    assert state["torch"] is ref
    assert torch.equal(ref, torch.get_rng_state())
    assert state["python"].tolist()[1:] == list(random.getstate()[1])


def test_snapshots_written_before_rng_tensors_still_restore() -> None:
    legacy = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": np.random.get_state()}
    expected = draws()
    rng.set_rng_state(roundtrip(legacy))  # type: ignore[arg-type]
    assert draws() == expected


def test_stateful_objects_are_checked() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert check_stateful({"scheduler": sched}) == {"scheduler": sched}
    assert check_stateful(None) == {}
    with pytest.raises(ConfigError, match=r"state\['epoch'\] \(int\) has no state_dict"):
        check_stateful({"epoch": 3})
    with pytest.raises(ConfigError, match="dict of name -> object"):
        check_stateful([sched])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty strings"):
        check_stateful({"": sched})


def test_scheduler_and_stateful_loader_state_survive_the_manifest() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for _ in range(3):
        opt.step()
        sched.step()
    loader = StatefulDataLoader(list(range(20)), batch_size=3, shuffle=True)
    it = iter(loader)
    next(it), next(it)
    saved = roundtrip({"scheduler": sched.state_dict(), "loader": loader.state_dict()})
    rest = [b.tolist() for b in it]

    sched2 = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), lambda s: 0.5 ** s)
    sched2.load_state_dict(saved["scheduler"])  # type: ignore[index]
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    loader2 = StatefulDataLoader(list(range(20)), batch_size=3, shuffle=True)
    loader2.load_state_dict(saved["loader"])  # type: ignore[index]
    assert [b.tolist() for b in loader2] == rest


def test_buffers_are_taken_at_save_time_parameters_are_not() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    snap = client.Snapshotter(model)  # not under ftrun: snapshots off, state still readable
    try:
        state = snap._training.capture(1, None)["model"]
        assert state["0.weight"].data_ptr() == model[0].weight.data_ptr()
        assert state["1.running_mean"].data_ptr() != model[1].running_mean.data_ptr()
        before = state["1.running_mean"].clone()
        model(torch.randn(4, 3))  # the next forward updates the statistics in place
        assert torch.equal(state["1.running_mean"], before)
    finally:
        snap.close()


def test_the_store_trusts_the_ranks_hash_table_and_restore_catches_a_later_flip() -> None:
    """A rank hashes what it wrote; a byte changed afterwards is refused at restore."""
    import os
    import time
    import uuid

    from snapshot_helpers import stage_segment

    from ftrun.protocol import Message
    from ftrun.snapshot import segment as shm
    from ftrun.snapshot import verify
    from ftrun.snapshot.manifest import entries
    from ftrun.store.api import StoreConfig
    from ftrun.store.store import SnapshotStore

    run_id = f"rh{uuid.uuid4().hex[:10]}"
    seg = stage_segment(run_id, 0, 0, {"w": torch.arange(1000.0)}, step=3, final_state=shm.STAGED)
    try:
        doc = parse_manifest(seg.manifest_bytes())
        with seg.data() as data:
            hashes = verify.hash_chunks(data, seg.header().chunk_size)
        seg.set_state(shm.STAGED, epoch="e1", hashes_xxh3=seg.write_hashes(hashes))
        with seg.data() as data:
            data[entries(doc)[0].offset] ^= 0xFF  # after the rank hashed, before the store
        store = SnapshotStore(StoreConfig(run_id=run_id, url="ipc:///nonexistent",
                                          coordinator=None, node_id="host/1",
                                          owner_pid=os.getpid()), b"s" * 32)
        kind, body = store.handle(Message("snap_staged", run_id, "test", time.time(), "id",
                                          {"rank": 0, "buffer": 0, "step": 3, "epoch": "e1"}))
        assert kind == "snap_done" and body["ok"]  # O(1): the table, not the data
        assert seg.header().state == shm.VERIFIED
        ok, reason = verify.check(seg)
        assert not ok and "hash mismatch" in reason
    finally:
        seg.unlink()
