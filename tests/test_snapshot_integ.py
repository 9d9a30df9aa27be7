"""Snapshots end to end: real ftrun, real store, real faults, bit-identical weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import xxhash
from conftest import TRAIN, Procs, full_matrix, read_events, result_line, wait_for

# These tests check exact steps (resumed from, persisted): no snapshot may be skipped.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

STEPS = 8


def job(procs: Procs, *train_args: str, ftrun_args: tuple[str, ...] = (), run_id: str | None = None,
        env: dict[str, str] | None = None, steps: int = STEPS) -> tuple[subprocess.Popen[str], str]:
    run_id = run_id or f"snap-{uuid.uuid4().hex[:8]}"
    proc = procs.ftrun(
        "--standalone", "--rdzv-id", run_id, "--nproc-per-node", "2", "--max-restarts", "2",
        *ftrun_args, TRAIN, "--steps", str(steps), *train_args, env=env,
    )
    return proc, run_id


def finish(procs: Procs, proc: subprocess.Popen[str], result: Path, timeout_s: float = 240) -> dict:
    code = procs.wait(proc, timeout_s)
    out = procs.output(proc)
    assert code == 0, f"exit {code}\n{out[-5000:]}"
    line = result_line(out)
    doc = json.loads(result.read_text())
    assert doc["params_xxh3"] in line
    return doc


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("snap-baseline")
    procs = Procs(tmp)
    try:
        proc, _ = job(procs, "--result", str(tmp / "r.json"),
                      env={"FTRUN_STATE_DIR": str(tmp / "state")})
        return finish(procs, proc, tmp / "r.json")["params_xxh3"]
    finally:
        procs.cleanup()


def fault_marker(state_dir: Path, run_id: str, rank: int, step: int) -> list[dict]:
    path = state_dir / "jobs" / run_id / f"fault-fired-rank{rank}-step{step}"
    assert path.exists(), f"the fault never fired: {path} missing"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "mode, fail_step, every",
    [("exit", 3, 1), ("kill", 6, 2), ("hang", 5, 3)],
)
def test_crash_resumes_from_memory_bit_identical(
    procs: Procs, state_dir: Path, tmp_path: Path, baseline: str, mode: str, fail_step: int, every: int
) -> None:
    result = tmp_path / "r.json"
    proc, run_id = job(procs, "--fail-at-step", str(fail_step), "--fail-rank", "1",
                       "--fail-mode", mode, "--snapshot-every", str(every), "--result", str(result),
                       "--pg-timeout", "600", ftrun_args=("--hang-timeout", "6"))
    doc = finish(procs, proc, result)
    fault_marker(state_dir, run_id, 1, fail_step)
    assert doc["params_xxh3"] == baseline
    expected = (fail_step - 1) // every * every
    assert doc["resumed_from"] == [expected]
    assert fail_step - expected <= every  # steps recomputed
    events = read_events(state_dir, run_id)
    assert any(e["type"] == "restore" and e["step"] == expected for e in events)
    if mode == "hang":
        hung = next(e for e in events if e["type"] == "hang_detected" and e["rank"] == 1)
        # Silent past --hang-timeout/2, the rank read suspect before it was killed.
        assert any(e["type"] == "rank_suspect" and e["pid"] == hung["pid"]
                   and e["cause"] == "no_progress" and e["seq"] < hung["seq"] for e in events)
        # Turning suspect, it wrote where it hangs (faulthandler's dump, down to the loop of
        # the hang mode in examples/train.py), and its launcher logged that as one block.
        out = procs.output(proc)
        assert "its threads' Python stacks follow" in out, out[-4000:]
        block = out[out.index("its threads' Python stacks:\n"):]
        assert "(most recent call first)" in block and "in _fire_fault" in block, out[-4000:]


def test_corrupted_snapshot_is_refused_and_an_older_one_used(
    procs: Procs, state_dir: Path, tmp_path: Path, baseline: str
) -> None:
    result = tmp_path / "r.json"
    proc, run_id = job(procs, "--fail-at-step", "5", "--fail-rank", "1", "--fail-mode", "corrupt",
                       "--snapshot-every", "1", "--result", str(result))
    doc = finish(procs, proc, result)
    marker = fault_marker(state_dir, run_id, 1, 5)
    assert marker[-1]["corrupted_step"] == 4
    assert doc["params_xxh3"] == baseline
    assert doc["resumed_from"] == [3]
    out = procs.output(proc)
    assert "snapshot of step 4 in buffer" in out and "hash mismatch" in out


def test_killing_the_store_loses_nothing(
    procs: Procs, state_dir: Path, tmp_path: Path, baseline: str
) -> None:
    from ftrun import jobs
    from ftrun.coordinator.client import request

    result = tmp_path / "r.json"
    proc, run_id = job(procs, "--fail-at-step", "7", "--fail-rank", "0", "--fail-mode", "kill",
                       "--snapshot-every", "1", "--step-sleep", "1.0", "--result", str(result))
    events_of = lambda kind: [e for e in read_events(state_dir, run_id) if e["type"] == kind]  # noqa: E731
    started = wait_for(lambda: events_of("store_started"), 60, "the store to start")
    store_pid = started[0]["pid"]
    secret = jobs.load_secret(run_id, create=False)
    endpoint = jobs.read_job_file(run_id).endpoint

    def committed() -> int | None:
        doc = request(endpoint, secret, run_id, "status_request", {}, timeout_s=5).body["doc"]
        snaps = doc.get("snapshots") or {}
        step = snaps.get("committed_step")
        return step if step and step >= 2 else None

    wait_for(committed, 120, "a committed snapshot", interval_s=0.2)
    os.kill(store_pid, signal.SIGKILL)
    wait_for(lambda: events_of("store_restarted"), 30, "the launcher to restart the store")
    doc = finish(procs, proc, result)
    fault_marker(state_dir, run_id, 0, 7)
    assert doc["params_xxh3"] == baseline
    assert doc["resumed_from"] == [6]


def _can_mount_tmpfs() -> bool:
    return os.geteuid() == 0 and Path("/proc/filesystems").read_text().find("tmpfs") >= 0


def test_too_small_shm_is_refused_with_the_fix(procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    if not _can_mount_tmpfs():
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small-shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(small)],
                   check=True, timeout=30)
    try:
        proc, _ = job(procs, ftrun_args=(), env={"FTRUN_SHM_DIR": str(small)})
        code = procs.wait(proc, 180)
        out = procs.output(proc)
        assert code != 0
        assert f"{small} has" in out and "needs" in out and "--shm-size" in out
        assert "Bus error" not in out and "SIGBUS" not in out
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False, timeout=30)


def _params_digest_from_checkpoint(rank_dir: Path) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(rank_dir))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader)  # plain DCP, nothing of ftrun
    manifest = json.loads((rank_dir / "ftrun-manifest.json").read_text())
    h = xxhash.xxh3_64()
    for entry in manifest["tensors"]:  # "/model/<fqn>" is stored as "model.<fqn>"
        if entry["key"].startswith("/model/"):
            key = "model." + entry["key"].removeprefix("/model/")
            h.update(state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def test_persist_then_a_new_job_resumes_from_disk(
    procs: Procs, state_dir: Path, tmp_path: Path, baseline: str
) -> None:
    persist = tmp_path / "ckpt"
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    first, _ = job(procs, "--result", str(r1), steps=6,
                   ftrun_args=("--persist-dir", str(persist), "--persist-every", "2"))
    doc1 = finish(procs, first, r1)
    rank0 = persist / "step_000000006" / "rank_00000"
    assert (rank0 / ".metadata").exists(), sorted(p.name for p in persist.iterdir())
    assert _params_digest_from_checkpoint(rank0) == doc1["params_xxh3"]
    inspected = subprocess.run(
        [sys.executable, "-m", "ftrun", "inspect", str(persist), "--json", "--verify"],
        capture_output=True, text=True, timeout=120,
    )
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["kind"] == "persisted" and report["step"] == 6

    second, _ = job(procs, "--result", str(r2),
                    ftrun_args=("--persist-dir", str(persist)))
    doc2 = finish(procs, second, r2)
    assert doc2["resumed_from"] == [6]
    assert doc2["params_xxh3"] == baseline


def test_fsdp2_shards_restore_bit_identical(procs: Procs, state_dir: Path) -> None:
    """DTensor shards (FSDP2 on CPU/gloo) go into snapshots and come back as DTensors: in a
    new process, and in place (``@ftrun.resilient``: the surviving rank builds FSDP2 again)."""
    worker = str(Path(__file__).with_name("fsdp_worker.py"))

    def run(*args: str) -> tuple[str, str]:
        proc = procs.ftrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                           worker, *args)
        out = procs.output(proc) if procs.wait(proc, 200) == 0 else ""
        assert out, procs.output(proc)[-4000:]
        # The first result line is the run's own: a worker that fails in gloo's teardown
        # after printing it (seen rarely under load) restarts the job once more.
        return [ln for ln in out.splitlines() if ln.startswith("fsdp:")][0], out

    def resumed_from_newest(line: str, out: str) -> None:
        # The fault hits in step 4: step 3 unless its snapshot had not committed by then (a
        # loaded host; the ranks skip a snapshot rather than wait, and say so).
        start = int(line.split("start=")[1].split()[0])
        assert start == 3 or (start == 2 and "skipped the snapshot of step" in out), \
            out[-4000:]

    clean, out = run("6")
    assert clean.startswith("fsdp: start=0 "), out[-4000:]
    if full_matrix():  # a further cell: new processes for both ranks (in place below)
        faulted, out = run("6", "4")
        resumed_from_newest(faulted, out)
        assert clean.split("hash=")[1] == faulted.split("hash=")[1]
    # In place: rank 0 keeps its process, builds FSDP2 again and restores its shards.
    in_place, out = run("6", "4", "--resilient")
    resumed_from_newest(in_place, out)
    assert clean.split("hash=")[1] == in_place.split("hash=")[1]
    assert "workers restarted in place" in out and "new processes for rank(s) [1]" in out, \
        out[-4000:]
