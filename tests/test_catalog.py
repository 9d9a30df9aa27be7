"""The store's catalog: a record of every shard it holds, served to whoever asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TRAIN, Procs, wait_for
from snapshot_helpers import stage_segment
from test_store_epoch import new_store, run_id, send  # noqa: F401 (fixture)

from ftrun.errors import FtrunError
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify


def test_records_say_whose_shard_of_which_step_and_its_chunk_hashes(run_id: str) -> None:  # noqa: F811
    store = new_store(run_id)
    a = stage_segment(run_id, 0, 0, {"w": torch.ones(16)}, step=3, world_size=2)
    b = stage_segment(run_id, 0, 1, {"w": torch.ones(16)}, step=4, world_size=2,
                      final_state=shm.WRITING)
    c = stage_segment(run_id, 1, 0, {"w": torch.zeros(16)}, step=3, world_size=2)
    reply = send(store, run_id, "catalog_request", hashes=True)
    assert reply["node_id"] == "host/1"
    got = {(r["rank"], r["buffer"]): r for r in reply["records"]}
    assert set(got) == {(0, 0), (0, 1), (1, 0)}
    assert got[(0, 0)]["state"] == "verified" and got[(0, 0)]["step"] == 3
    assert got[(0, 0)]["origin"] == "host/1" and got[(0, 0)]["segment"] == a.name
    with a.data() as data:
        want = [f"{h:016x}" for h in verify.hash_chunks(data, a.header().chunk_size)]
    assert got[(0, 0)]["hashes"] == want
    assert got[(0, 1)]["state"] == "writing" and got[(0, 1)]["hashes"] is None
    only = send(store, run_id, "catalog_request", rank=1)["records"]
    assert [(r["rank"], r["hashes"]) for r in only] == [(1, 1)]  # a count without hashes=True
    for seg in (a, b, c):
        seg.close()


def test_another_launchers_live_segments_are_not_in_the_catalog(run_id: str) -> None:  # noqa: F811
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        seg = stage_segment(run_id, 5, 0, {"w": torch.ones(4)}, step=1, owner_pid=other.pid)
        store = new_store(run_id)
        assert send(store, run_id, "catalog_request")["records"] == []
        seg.close()
    finally:
        other.kill()
        other.wait(timeout=30)
    # Its launcher is gone: the store adopts the segment.
    assert [r["rank"] for r in send(new_store(run_id), run_id, "catalog_request")["records"]] \
        == [5]


def test_fault_injection_goes_through_the_store(run_id: str) -> None:  # noqa: F811
    store = new_store(run_id)
    with pytest.raises(FtrunError, match="no verified shard of rank 0"):
        send(store, run_id, "fault_corrupt", rank=0)
    old = stage_segment(run_id, 0, 0, {"w": torch.ones(64)}, step=5)
    new = stage_segment(run_id, 0, 1, {"w": torch.ones(64)}, step=6)
    hit = send(store, run_id, "fault_corrupt", rank=0)
    assert hit["step"] == 6 and hit["segment"] == new.name
    assert new.header().state == shm.VERIFIED  # silent: state and hashes unchanged
    assert not verify.check(new)[0] and verify.check(old) == (True, "")
    assert os.path.exists(old.path)
    old.close()
    new.close()


@pytest.mark.integration
def test_inspect_of_a_live_job_asks_its_store(procs: Procs, state_dir: Path) -> None:
    from ftrun import jobs
    from ftrun.coordinator.client import request

    job_id = f"cat-{uuid.uuid4().hex[:8]}"
    proc = procs.ftrun("--rdzv-id", job_id, "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "0", TRAIN, "--steps", "40", "--layers", "1",
                       "--dim", "32", "--step-sleep", "0.25")

    def committed() -> int | None:
        try:
            endpoint = jobs.read_job_file(job_id).endpoint
            secret = jobs.load_secret(job_id, create=False)
            doc = request(endpoint, secret, job_id, "status_request", {}, timeout_s=5).body["doc"]
        except FtrunError:
            return None
        step = (doc.get("snapshots") or {}).get("committed_step")
        return step if step and step >= 3 else None

    wait_for(committed, 120, "a committed snapshot", interval_s=0.2)
    out = subprocess.run([sys.executable, "-m", "ftrun", "inspect", job_id, "--json", "--verify"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    [store] = doc["stores"]
    assert store["reachable"] and store["shards"] == 4, store
    assert sorted((s["rank"], s["buffer"]) for s in doc["segments"]) == [(0, 0), (0, 1), (1, 0),
                                                                          (1, 1)]
    assert doc["verify"]["mismatches"] == [] and doc["verify"]["tensors"] > 0
    assert procs.wait(proc, 240) == 0, procs.output(proc)[-3000:]
    # The launcher takes its store's address with it.
    assert jobs.store_urls(job_id) == []
