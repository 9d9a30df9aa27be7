"""A stalled snapshot store costs snapshots, not the job: no step waits for it (the default
--snapshot-wait 0), the skips are counted in ftrun status, and once the store is back the ranks,
which skipped different steps, commit again; a rank killed after that restores the newest
committed step and the job ends bit-identical to a run without snapshots."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from conftest import TRAIN, Procs, read_events, result_line, wait_for

pytestmark = pytest.mark.integration


def test_a_stopped_store_skips_snapshots_and_training_goes_on(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    from ftrun import jobs
    from ftrun.coordinator.client import request

    steps = tmp_path / "steps.jsonl"
    run_id = f"stall-{uuid.uuid4().hex[:8]}"
    launcher = ("--standalone", "--nproc-per-node", "2")
    script = (TRAIN, "--steps", "20", "--layers", "1", "--dim", "32")
    result = tmp_path / "result.json"
    proc = procs.ftrun("--rdzv-id", run_id, *launcher, "--max-restarts", "1", *script,
                       "--snapshot-every", "1", "--step-sleep", "0.3", "--step-log", str(steps),
                       "--fail-at-step", "18", "--fail-rank", "1", "--fail-mode", "kill",
                       "--fault-dir", str(tmp_path), "--result", str(result))
    started = wait_for(lambda: [e for e in read_events(state_dir, run_id)
                                if e["type"] == "store_started"], 60, "the store to start")
    store_pid = started[0]["pid"]
    secret = jobs.load_secret(run_id, create=False)
    endpoint = jobs.read_job_file(run_id).endpoint

    def committed() -> int | None:
        doc = request(endpoint, secret, run_id, "status_request", {}, timeout_s=5).body["doc"]
        step = (doc.get("snapshots") or {}).get("committed_step")
        return step if step and step >= 2 else None

    before = wait_for(committed, 120, "a committed snapshot", interval_s=0.2)

    def done_steps() -> list[int]:
        if not steps.exists():
            return []
        return [json.loads(line)["step"] for line in steps.read_text().splitlines() if line]

    os.kill(store_pid, signal.SIGSTOP)
    try:
        at_stop = len(done_steps())
        # Without a store nothing commits; if saves waited for it, no step would complete.
        wait_for(lambda: len(done_steps()) >= at_stop + 4, 60,
                 "four steps to complete while the store is stopped")
    finally:
        os.kill(store_pid, signal.SIGCONT)
    # The skips reach ftrun status with the next snapshot the store takes in.
    def skipped() -> int:
        snaps = request(endpoint, secret, run_id, "status_request", {},
                        timeout_s=5).body["doc"].get("snapshots") or {}
        return int(snaps.get("skipped") or 0) if snaps.get("every") == 1 else 0

    wait_for(skipped, 60, "ftrun status to count the skipped snapshots", interval_s=0.2)
    # Each rank gave up the snapshots it could not place, not necessarily the same ones: the
    # steps some ranks skipped are dead, and the next step every rank took commits.
    wait_for(lambda: (committed() or 0) > before + 4, 60,
             "a step taken after the store came back to commit", interval_s=0.2)
    code = procs.wait(proc, 240)
    out = procs.output(proc)
    assert code == 0, out[-4000:]
    assert "skipped the snapshot of step" in out, out[-4000:]
    assert (tmp_path / "fault-fired-rank1-step18").exists(), "the fault never fired"
    resumed = json.loads(result.read_text())["resumed_from"]
    assert len(resumed) == 1 and 0 < resumed[0] < 18, resumed

    # Skipped snapshots change nothing in training: same weights as a run without snapshots.
    plain = procs.ftrun("--rdzv-id", f"{run_id}-plain", *launcher, "--max-restarts", "0",
                        *script, "--snapshot-every", "0",
                        name="plain")
    assert procs.wait(plain, 240) == 0, procs.output(plain)[-4000:]
    assert result_line(out).split("params_xxh3=")[1] == \
        result_line(procs.output(plain)).split("params_xxh3=")[1]
