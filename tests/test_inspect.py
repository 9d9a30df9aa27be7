"""``ftrun inspect``: persisted checkpoints and live segments, tables, JSON, --verify, errors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from snapshot_helpers import stage_segment, write_plain

from ftrun import exit_codes, jobs, protocol
from ftrun.cli import inspect as inspect_cli
from ftrun.errors import UnreachableError
from ftrun.snapshot import persist
from ftrun.snapshot.manifest import flatten
from ftrun.snapshot.segment import STAGED, WRITING, Segment, segment_name

# -- helpers ----------------------------------------------------------------------------------


def make_state(seed: int = 0, step: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"fc.weight": torch.randn(3, 2, generator=g), "fc.bias": torch.zeros(3) + seed},
        "optim": {"state": {0: {"exp_avg": torch.ones(3, 2)}}, "param_groups": [{"lr": 0.1}]},
        "rng": {"torch": torch.arange(8, dtype=torch.uint8)},
        "extra": {"epoch": 1},
        "step": step,
    }


class Live:
    """Segments of one made-up run id; all unlinked at teardown."""

    def __init__(self) -> None:
        self.run_id = f"ti{uuid.uuid4().hex[:10]}"
        self.made: list[Segment] = []

    def stage(self, rank: int, buffer: int, state: Any, **kw: Any) -> Segment:
        seg = stage_segment(self.run_id, rank, buffer, state, **kw)
        self.made.append(seg)
        return seg

    def empty(self, rank: int, buffer: int) -> Segment:
        seg = Segment.create(segment_name(self.run_id, rank, buffer), manifest_cap=4096,
                             n_tensors=0, data_len=0, owner_pid=os.getpid())
        self.made.append(seg)
        return seg


@pytest.fixture
def live() -> Iterator[Live]:
    lv = Live()
    try:
        yield lv
    finally:
        for seg in lv.made:
            seg.unlink()


@pytest.fixture
def workdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ftrun-test-inspect-"))
    monkeypatch.setenv("FTRUN_STATE_DIR", str(d / "state"))
    monkeypatch.delenv("FTRUN_SECRET", raising=False)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], workdir: Path) -> Run:
    def go(target: str | Path, *, step: int | None = None, json_out: bool = False,
           verify: bool = False) -> tuple[int, str, str]:
        capsys.readouterr()
        code = inspect_cli.run_inspect(str(target), step=step, json_out=json_out, verify=verify,
                                       state_dir=str(workdir / "state"))
        out, err = capsys.readouterr()
        return code, out, err

    return go


def run_json(run: Run, target: str | Path, **kw: Any) -> tuple[int, dict[str, Any]]:
    code, out, _err = run(target, json_out=True, **kw)
    assert out.endswith("\n") and out.count("\n") == 1, out
    return code, json.loads(out)


@pytest.fixture
def ckpt(workdir: Path) -> Path:
    """Steps 10 and 20 complete (2 ranks), step 30 partial (rank 1 still being written)."""
    root = workdir / "persist"
    for step in (10, 20, 30):
        for rank in (0, 1):
            if step == 30 and rank == 1:
                continue
            write_plain(root, make_state(rank, step), step=step, rank=rank, world_size=2)
    (root / "step_000000030" / ".tmp-rank_00001-77").mkdir()
    return root


# -- persisted --------------------------------------------------------------------------------


def test_persist_dir_tables(run: Run, ckpt: Path) -> None:
    code, out, err = run(ckpt)
    assert code == exit_codes.OK, err
    assert "complete" in out and "partial" in out
    assert "20 *" in out  # newest complete step is the chosen one
    assert "/model/fc.weight" in out and "float32" in out and "(3, 2)" in out
    h = persist.read_hashes(ckpt / "step_000000020" / "rank_00001")["/model/fc.weight"]
    assert persist.xxh3_hex(h) in out
    assert "step 20: 2 rank(s), 8 tensor(s)" in out


def test_persist_dir_json(run: Run, ckpt: Path) -> None:
    code, doc = run_json(run, ckpt)
    assert code == exit_codes.OK
    assert doc["version"] == 1 and doc["kind"] == "persisted" and doc["target"] == "persist_dir"
    assert [(s["step"], s["status"], s["ranks"], s["pending"]) for s in doc["steps"]] == [
        (30, "partial", [0], 1), (20, "complete", [0, 1], 0), (10, "complete", [0, 1], 0)]
    assert doc["step"] == 20 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    tensors = {t["key"]: t for t in doc["ranks"][1]["tensors"]}
    assert tensors["/model/fc.bias"] == {
        "key": "/model/fc.bias", "dtype": "float32", "shape": [3], "bytes": 12,
        "xxh3": persist.xxh3_hex(xxhash.xxh3_64_intdigest((torch.zeros(3) + 1).numpy()))}
    assert doc["totals"] == {"ranks": 2, "tensors": 8, "bytes": 2 * (24 + 12 + 24 + 8)}
    assert doc["verify"] is None and doc["problems"] == []

    code, doc = run_json(run, ckpt, step=30)
    assert code == exit_codes.OK and doc["step"] == 30 and len(doc["ranks"]) == 1


def test_step_and_rank_dirs(run: Run, ckpt: Path) -> None:
    code, doc = run_json(run, ckpt / "step_000000010")
    assert code == exit_codes.OK and doc["target"] == "step_dir" and doc["step"] == 10
    assert doc["totals"]["ranks"] == 2
    code, doc = run_json(run, ckpt / "step_000000010" / "rank_00001")
    assert code == exit_codes.OK and doc["target"] == "rank_dir"
    assert [r["rank"] for r in doc["ranks"]] == [1] and doc["totals"]["ranks"] == 1
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(10, "complete")]


def test_missing_step_is_not_found(run: Run, ckpt: Path) -> None:
    code, out, err = run(ckpt, step=15)
    assert code == exit_codes.NOT_FOUND and out == ""
    assert "no step 15" in err and "30, 20, 10" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_foreign_and_corrupt_dirs(run: Run, workdir: Path, ckpt: Path) -> None:
    foreign = workdir / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hi")
    code, out, err = run(foreign)
    assert code == exit_codes.USAGE and out == "" and err.count("\n") == 1
    assert "not an ftrun checkpoint" in err

    (workdir / "empty").mkdir()
    code, _out, err = run(workdir / "empty")
    assert code == exit_codes.USAGE and "is empty" in err

    code, _out, err = run(foreign / "notes.txt")
    assert code == exit_codes.USAGE and "is a file" in err

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(workdir / "plain"), no_dist=True)
    code, _out, err = run(workdir / "plain")
    assert code == exit_codes.USAGE and "plain torch.distributed.checkpoint" in err

    code, _out, err = run(ckpt / "step_000000030" / ".tmp-rank_00001-77")
    assert code == exit_codes.FAILED and "unfinished write" in err

    bad_json = ckpt / "step_000000010" / "rank_00000"
    (bad_json / persist.MANIFEST_FILE).write_text("{not json")
    code, out, err = run(bad_json)
    assert code == exit_codes.FAILED and out == "" and err.count("\n") == 1
    assert persist.MANIFEST_FILE in err

    no_meta = ckpt / "step_000000020" / "rank_00001"
    (no_meta / ".metadata").unlink()
    code, _out, err = run(no_meta)
    assert code == exit_codes.FAILED and ".metadata is missing" in err

    # The whole persist dir still lists, but says what is corrupt and fails.
    code, doc = run_json(run, ckpt)
    assert code == exit_codes.FAILED
    assert {s["step"]: s["status"] for s in doc["steps"]} == {
        30: "partial", 20: "corrupt", 10: "corrupt"}
    assert len(doc["problems"]) == 2


def test_verify_on_disk(run: Run, ckpt: Path) -> None:
    code, out, _err = run(ckpt, verify=True)
    assert code == exit_codes.OK and "verified 8 tensor(s)" in out and "all hashes match" in out

    rank_dir = ckpt / "step_000000020" / "rank_00001"
    [distcp] = rank_dir.glob("*.distcp")
    raw = bytearray(distcp.read_bytes())
    at = raw.find((torch.zeros(3) + 1).numpy().tobytes())
    assert at > 0
    raw[at] ^= 0x01
    distcp.write_bytes(bytes(raw))
    code, doc = run_json(run, ckpt, verify=True)
    assert code == exit_codes.FAILED
    [bad] = doc["verify"]["mismatches"]
    assert bad["rank"] == 1 and bad["key"] == "/model/fc.bias" and bad["file"] == str(distcp)
    assert doc["verify"]["tensors"] == 8
    code, out, _err = run(ckpt, verify=True)
    assert code == exit_codes.FAILED and "MISMATCH" in out and "/model/fc.bias" in out


# -- live -------------------------------------------------------------------------------------


def test_live_segments(run: Run, live: Live) -> None:
    live.stage(0, 0, make_state(0, 10), step=10, world_size=2)
    live.stage(0, 1, make_state(0, 20), step=20, world_size=2, final_state=STAGED)
    live.stage(1, 0, make_state(1, 10), step=10, world_size=2)
    live.stage(1, 1, make_state(1, 20), step=20, world_size=2, final_state=WRITING)

    code, doc = run_json(run, live.run_id)
    assert code == exit_codes.OK, doc["problems"]
    assert doc["version"] == 1 and doc["kind"] == "live" and doc["run_id"] == live.run_id
    assert [(s["rank"], s["buffer"], s["state"], s["step"]) for s in doc["segments"]] == [
        (0, 0, "verified", 10), (0, 1, "staged", 20), (1, 0, "verified", 10),
        (1, 1, "writing", 20)]
    assert doc["segments"][0]["owner_alive"] is True and doc["segments"][0]["tensors"] == 4
    assert doc["coordinator"] is None
    assert doc["step"] == 10 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["chunks"]["hashed"] and r["chunks"]["count"] == 1 for r in doc["ranks"])
    assert doc["totals"]["tensors"] == 8

    code, doc = run_json(run, live.run_id, step=20)
    assert code == exit_codes.OK and [r["rank"] for r in doc["ranks"]] == [0]
    assert doc["ranks"][0]["state"] == "staged"
    assert not doc["ranks"][0]["chunks"]["hashed"]

    code, _out, err = run(live.run_id, step=99)
    assert code == exit_codes.NOT_FOUND and "steps held: 10, 20" in err

    code, out, _err = run(live.run_id)
    assert code == exit_codes.OK
    for word in ("verified", "staged", "writing", "/optim/state/0/exp_avg", "step 10"):
        assert word in out


def test_live_verify_detects_flipped_byte(run: Run, live: Live) -> None:
    seg = live.stage(0, 0, make_state(), step=5)
    live.empty(0, 1)
    code, doc = run_json(run, live.run_id, verify=True)
    assert code == exit_codes.OK and doc["verify"]["mismatches"] == []
    assert doc["verify"]["tensors"] == 4
    assert {s["state"] for s in doc["segments"]} == {"verified", "empty"}

    entry = next(e for e in flatten(make_state()).tensors if e.key == "/model/fc.weight")
    h = seg.header()
    seg.mm[h.data_off + entry.offset + 3] ^= 0x10
    code, doc = run_json(run, live.run_id, verify=True)
    assert code == exit_codes.FAILED
    [bad] = doc["verify"]["mismatches"]
    assert "/model/fc.weight" in bad["keys"] and bad["rank"] == 0 and bad["chunk"] == 0


def test_unknown_run_id_is_not_found(run: Run) -> None:
    code, out, err = run(f"nosuch{uuid.uuid4().hex[:8]}")
    assert code == exit_codes.NOT_FOUND and out == "" and "no job" in err


def _job(workdir: Path, run_id: str) -> None:
    jobs.load_secret(run_id, str(workdir / "state"))
    jobs.write_job_file(jobs.JobFile(run_id, "127.0.0.1:1", "host", 1, time.time()),
                        str(workdir / "state"))


def test_coordinator_snapshots(run: Run, live: Live, workdir: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    live.stage(0, 0, make_state(), step=5)
    _job(workdir, live.run_id)
    snaps = {"epoch": "e1", "world_size": 1, "committed_step": 5, "persisted_step": None}
    calls = []

    def fake_request(endpoint: str, secret: bytes, job: str, kind: str, body: dict[str, Any],
                     *, timeout_s: float) -> protocol.Message:
        calls.append((endpoint, job, kind, timeout_s))
        return protocol.Message("status_reply", job, "coordinator", time.time(), "1",
                                {"doc": {"snapshots": snaps}})

    monkeypatch.setattr(inspect_cli, "request", fake_request)
    code, doc = run_json(run, live.run_id)
    assert code == exit_codes.OK
    assert calls == [("127.0.0.1:1", live.run_id, "status_request", 2.0)]
    assert doc["coordinator"]["reachable"] is True and doc["coordinator"]["snapshots"] == snaps
    code, out, _err = run(live.run_id)
    assert "committed_step 5" in out


def test_coordinator_unreachable_job_without_segments(run: Run, workdir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = f"ti{uuid.uuid4().hex[:10]}"
    _job(workdir, run_id)

    def down(*_a: Any, **_kw: Any) -> protocol.Message:
        raise UnreachableError("no answer in 2 s")

    monkeypatch.setattr(inspect_cli, "request", down)
    code, doc = run_json(run, run_id)
    assert code == exit_codes.OK and doc["segments"] == [] and doc["step"] is None
    assert doc["coordinator"]["reachable"] is False
    assert "not reachable" in doc["coordinator"]["note"]
    code, out, _err = run(run_id)
    assert code == exit_codes.OK and "not reachable" in out and "no staged or verified" in out


# -- durable steps and replica locations (a real coordinator) -----------------------------------


@pytest.fixture
def coordinator(workdir: Path) -> Iterator[tuple[str, Callable[..., Any]]]:
    """A real coordinator of a made-up job, its job file written; yields the run id and a
    function sending it a message as a store would."""
    from ftrun.coordinator.server import Coordinator
    from ftrun.protocol.transport import Client

    run_id = f"ti{uuid.uuid4().hex[:10]}"
    state = str(workdir / "state")
    secret = jobs.load_secret(run_id, state)
    coord = Coordinator(run_id, secret, bind_host="127.0.0.1")
    coord.start()
    jobs.write_job_file(jobs.JobFile(run_id, coord.endpoint, "host", os.getpid(), time.time()),
                        state)
    client = Client(coord.endpoint, secret, run_id, "test-store", peer="coordinator")

    def send(kind: str, **body: Any) -> Any:
        return client.request(kind, body, None, 5.0).body

    try:
        yield run_id, send
    finally:
        client.close()
        coord.stop(timeout_s=2)


def _store_report(send: Callable[..., Any], node: str, ranks: list[int]) -> Any:
    return send("store_report", node_id=node, bytes=0, segments=0, persisted_step=None,
                ranks=ranks, replicas=2, replica_addr=f"127.0.0.1:{ranks[0] + 1}")


def test_committed_durable_and_replica_locations(run: Run,
                                                 coordinator: tuple[str, Any]) -> None:
    run_id, send = coordinator
    for node, rank in (("n0", 0), ("n1", 1)):
        _store_report(send, node, [rank])
    send("snap_epoch", node_id="n0", epoch="e1", base_step=0, world_size=2)
    for step in (4, 6):
        for node, rank in (("n0", 0), ("n1", 1)):
            send("snap_verified", node_id=node, epoch="e1", rank=rank, step=step, nbytes=8)
    # Step 4: each node holds the other's shard. Step 6: only rank 0's replica so far.
    send("replica_verified", node_id="n1", origin="n0", epoch="e1", rank=0, step=4)
    send("replica_verified", node_id="n0", origin="n1", epoch="e1", rank=1, step=4)
    send("replica_verified", node_id="n1", origin="n0", epoch="e1", rank=0, step=6)

    code, doc = run_json(run, run_id)
    assert code == exit_codes.OK
    d = doc["durability"]
    assert (d["replicas"], d["committed_step"], d["durable_step"], d["durable_off"],
            d["durable_lag_steps"]) == (2, 6, 4, None, 2)
    assert d["shards"] == [
        {"step": 4, "rank": 0, "node": "n0", "replicas": ["n1"], "durable": True},
        {"step": 4, "rank": 1, "node": "n1", "replicas": ["n0"], "durable": True},
        {"step": 6, "rank": 0, "node": "n0", "replicas": ["n1"], "durable": False},
        {"step": 6, "rank": 1, "node": "n1", "replicas": [], "durable": False},
    ]
    code, out, _err = run(run_id)
    assert code == exit_codes.OK
    assert "committed step 6; durable step 4 (2 step(s)" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["4", "(durable)", "1", "n1", "n0"] in rows and ["6", "1", "n1", "none"] in rows


def test_one_node_shows_durable_as_not_possible(run: Run,
                                                coordinator: tuple[str, Any]) -> None:
    run_id, send = coordinator
    plan = _store_report(send, "n0", [0, 1])
    assert plan["peers"] == [] and "no peer node" in plan["off"]
    send("snap_epoch", node_id="n0", epoch="e1", base_step=0, world_size=2)
    for rank in (0, 1):
        send("snap_verified", node_id="n0", epoch="e1", rank=rank, step=3, nbytes=8)
    code, doc = run_json(run, run_id)
    assert code == exit_codes.OK
    d = doc["durability"]
    assert d["durable_off"] == plan["off"] and d["durable_step"] is None and d["shards"] == []
    code, out, _err = run(run_id)
    assert "committed step 3; durable n/a: one node: no peer node" in out
