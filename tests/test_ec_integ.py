"""Erasure-coded snapshots between real stores: launchers on localhost with --redundancy
ec:2+1, one training launcher killed with its ranks and store after a durable step; the
spare takes its place, its shards are rebuilt from the group's parity and data, and the job
ends bit-identical to the fault-free run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TRAIN, Procs, free_port, read_events, result_line, wait_for

from ftrun.errors import IntegrityError
from ftrun.snapshot import segment as shm
from ftrun.store.ec_store import ec_prefix
from ftrun.testing.procs import kill_sessions

# Two jobs one after the other (the fault-free one is the reference); each start of a worker
# imports torch, which takes tens of seconds on a loaded 2-CPU machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 40  # enough steps after the restore for ftrun status to be asked while it runs
# A model of ~5.6 MB of state per rank: two 4 MiB chunks, the last one partial, so that each
# of the K = 2 slices of a shard holds a chunk and the stripes' data slices differ in length.
TRAIN_ARGS = ("--dim", "128", "--batch", "6", "--snapshot-every", "1")
DURABLE = re.compile(r"erasure coding: step (\d+) is durable")
REBUILT = re.compile(r"erasure coding: rebuilt rank (\d+)'s shard of step (\d+) \(lost node (\S+),")
RESUMED = re.compile(r"rank (\d+) resumed from step (\d+) \(.*?\), from (.+)$", re.M)


def _train(tmp: Path, tag: str, *extra: str) -> list[str]:
    return [TRAIN, "--steps", str(STEPS), *TRAIN_ARGS, "--result", str(tmp / f"{tag}.json"),
            *extra]


def _lose_node(run_id: str, launcher: subprocess.Popen[str]) -> list[str]:
    """Kill a launcher with its ranks and store, and its memory with them: it is stopped, its
    segments (rank buffers, fragments) removed, then it is killed. On one host, another
    store of the job would otherwise adopt the dead launcher's rank buffers. Returns the
    names removed."""
    os.killpg(launcher.pid, signal.SIGSTOP)
    removed = []
    for prefix in (shm.job_prefix(run_id), ec_prefix(run_id)):
        for path in shm.list_segments(prefix):
            try:
                seg = shm.Segment.open(path)
                try:
                    owner = seg.header().owner_pid
                finally:
                    seg.close()
            except (OSError, ValueError, IntegrityError):
                continue
            if owner == launcher.pid:
                path.unlink(missing_ok=True)
                removed.append(path.name)
    kill_sessions([launcher])
    return removed


def _status(run_id: str, text: bool = False) -> Any:
    out = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id,
                          *(() if text else ("--json",))],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    if out.returncode not in (0, 3):
        return None
    if text:
        return out.stdout
    return json.loads(out.stdout)


def _cleanup_segments(run_id: str) -> None:
    for prefix in (shm.job_prefix(run_id), ec_prefix(run_id)):
        for path in shm.list_segments(prefix):
            path.unlink(missing_ok=True)


def test_lost_node_restored_from_rebuilt_shards_matches_fault_free(
        procs: Procs, state_dir: Path, tmp_path: Path, exact_steps: None) -> None:
    run_id = f"ec-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cmd = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--redundancy", "ec:2+1", "--replica-addr", "127.0.0.1", "--max-restarts", "3",
           *_train(tmp_path, "ec", "--step-sleep", "0.2")]
    try:
        # 3 training launchers and a spare, started alike
        nodes = [procs.ftrun(*cmd, name=f"node{i}") for i in range(4)]

        def durable() -> int | None:
            for node in nodes:
                assert node.poll() is None, f"a launcher exited:\n{procs.output(node)[-3000:]}"
            found = [int(s) for n in nodes for s in DURABLE.findall(procs.output(n))]
            return max(found) if found and max(found) >= 3 else None

        step = wait_for(durable, 120, "a step durable under ec:2+1", interval_s=0.5)
        started = [e for e in read_events(state_dir, run_id) if e["type"] == "workers_started"]
        training = {e["node"].rsplit("/", 1)[1] for e in started}
        assert len(training) == 3, started
        # the victim: a training launcher that hosts neither the rendezvous store nor the
        # coordinator (the launcher that binds the rendezvous port runs both)
        hosting = [n for n in nodes if f"coordinator of job {run_id} listening" in
                   procs.output(n)]
        assert len(hosting) == 1, [procs.output(n)[-2000:] for n in nodes]
        victim = next(n for n in nodes if str(n.pid) in training and n is not hosting[0])
        [spare] = [n for n in nodes if str(n.pid) not in training]
        removed = _lose_node(run_id, victim)
        assert any(name.startswith(shm.job_prefix(run_id)) for name in removed), removed
        survivors = [n for n in nodes if n is not victim]

        # resumed: the new placement (the survivors and the spare) builds parity again, and
        # ftrun status shows the code in force and the parity's progress
        def resumed_and_durable() -> int | None:
            logs = "".join(procs.output(n) for n in survivors)
            found = RESUMED.findall(logs)
            if len(found) < 3:
                return None
            after = [int(s) for s in DURABLE.findall(logs) if int(s) > int(found[0][1])]
            return max(after) if after else None

        wait_for(resumed_and_durable, 150, "a durable step after the restore", interval_s=0.5)
        # The stores report their parity with their node's heartbeats: the spare's first
        # built step shows in the status a moment after its log says so (CI: -1 at once).
        def spare_built() -> dict | None:
            doc = _status(run_id)
            parity = ((doc or {}).get("snapshots") or {}).get("parity") or {}
            mine = [p for node, p in parity.items() if node.endswith(f"/{spare.pid}")]
            return doc if mine and (mine[0].get("built_step") or -1) > step else None

        doc = wait_for(spare_built, 60, "the spare's parity built in ftrun status",
                       interval_s=0.5)
        snaps = doc["snapshots"]
        assert snaps["redundancy"] == "ec:2+1", snaps
        assert snaps["parity_durable_step"] >= step, snaps
        [joined] = [p for node, p in snaps["parity"].items() if node.endswith(f"/{spare.pid}")]
        assert joined["built_step"] > step and joined["parity_bytes"] > 0, snaps["parity"]
        text = _status(run_id, text=True)
        assert "ec:2+1: durable step" in text and "MB of parity" in text, text
        for node in survivors:
            assert procs.wait(node, 180) == 0, procs.output(node)[-4000:]
        logs = "".join(procs.output(n) for n in survivors)
        final = result_line(logs)

        # the fault fired and the spare took the victim's place
        assert victim.returncode is not None and victim.returncode < 0
        later = [e for e in read_events(state_dir, run_id) if e["type"] == "workers_started"
                 and e["node"].endswith(f"/{spare.pid}")]
        assert later, "the spare never started workers"
        # the lost node's shard was rebuilt (by at least one store), at the step every rank
        # resumed from, which is no older than the last durable one seen before the kill
        rebuilt = {(int(r), int(s), n) for r, s, n in REBUILT.findall(logs)}
        assert rebuilt, logs[-6000:]
        assert all(n.endswith(f"/{victim.pid}") for _, _, n in rebuilt), rebuilt
        resumed = RESUMED.findall(logs)
        assert len(resumed) == 3, resumed
        steps = {int(s) for _, s, _ in resumed}
        assert len(steps) == 1 and steps.pop() >= step, (resumed, step)
        assert {int(s) for _, s, _ in rebuilt} == {int(resumed[0][1])}
        # every rank resumed from memory: the lost rank's shard, whose only bytes in memory
        # were removed with its node, from the shard rebuilt from the parity
        assert all(src.startswith("memory") for _, _, src in resumed), resumed
        assert {r for r, _, _ in rebuilt} <= {int(r) for r, _, _ in resumed}
    finally:
        kill_sessions(procs.procs)
        _cleanup_segments(run_id)

    # the fault-free run: the same job on one launcher of three ranks
    ref_id = f"ecref-{uuid.uuid4().hex[:8]}"
    try:
        ref = procs.ftrun("--nnodes", "1", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", ref_id,
                          "--replicas", "1", *_train(tmp_path, "ref"), name="reference")
        assert procs.wait(ref, 180) == 0, procs.output(ref)[-4000:]
        assert result_line(procs.output(ref)) == final
    finally:
        kill_sessions(procs.procs)
        _cleanup_segments(ref_id)
