"""The short chaos run (``bench/chaos.py --short``): one two-node job takes one fault of every
kind, each fires, and the job ends with the fault-free run's weights."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, ROOT

# The run checks the step each restart resumes from, so a snapshot waits for its buffer
# rather than being skipped when the store is merely slow (see the exact_steps fixture); the
# never-wait default runs bit-identical in tests/test_snapshot_stall.py. The wait is kept under
# the run's --hang-timeout (10 s), not exact_steps' 60 s: after the store kill the ranks'
# claims are refused until the restarted store serves and replication to it resumes (a rank
# keeps the newest durable step meanwhile), seconds on a loaded host, and a 60 s wait turned
# that into a stall the hang timeout ended. With 5 s a step waits at most that, then skips.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(720)]


@pytest.fixture(autouse=True)
def _bounded_snapshot_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_SNAPSHOT_WAIT", "5")

SEED = 1
KINDS = {"kill", "stop", "raise", "hang", "corrupt", "store-kill", "sigterm", "persist-corrupt"}


def _run_chaos(work: Path, report: Path) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--short", "--seed", str(SEED),
         "--json", str(report), "--work-dir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    try:
        out, _ = proc.communicate(timeout=660)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # chaos.py stops and reaps its jobs on SIGTERM
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # its launchers die with it (parent-death signal)
            out, _ = proc.communicate(timeout=30)
        raise AssertionError(
            f"bench/chaos.py --short did not finish in 660 s:\n{out[-6000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for leftover in Path("/dev/shm").glob(f"ftrun-chaos-{proc.pid}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return proc.returncode, out


# ~210 s in CI: every fault kind it mixes has a test of its own in CI; the mix runs with
# FTRUN_FULL_MATRIX=1 (and in full from bench/chaos.py).
@FULL_MATRIX
def test_short_chaos_run_every_fault_fires_and_weights_match(tmp_path: Path) -> None:
    work, report = tmp_path / "chaos", tmp_path / "chaos.json"
    code, out = _run_chaos(work, report)
    assert report.exists(), f"no report (exit {code}):\n{out[-6000:]}"
    doc = json.loads(report.read_text())
    faults = doc["faults"]
    assert {f["kind"] for f in faults} == KINDS, faults

    # Every scheduled fault fired. Rank faults: their marker, read here, not from the report.
    markers = work / "faulted" / "faults"
    for f in faults:
        assert f["fired"], f"fault not fired: {f}\n{out[-6000:]}"
        if f["kind"] in {"kill", "stop", "raise", "hang", "corrupt"}:
            marker = markers / f"fault-fired-rank{f['rank']}-step{f['step']}"
            assert marker.exists(), f"{marker} missing"
            info = json.loads(marker.read_text().splitlines()[0])
            assert (info["mode"], info["rank"], info["step"]) == (f["kind"], f["rank"], f["step"])
    # Harness faults: what ftrun recorded about them in its event log.
    events_file = next((work / "faulted" / "state" / "jobs").glob("*/events.jsonl"))
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line]
    store_kills = sum(1 for f in faults if f["kind"] == "store-kill")
    assert sum(1 for e in events if e["type"] == "store_restarted"
               and e["exitcode"] == -signal.SIGKILL) == store_kills
    # Each SIGTERM ended an invocation with 143 (the launchers' own exit codes are checked by
    # the harness; a node whose coordinator is already gone cannot log its job_end), and the
    # same job was started again.
    sigterms = sum(1 for f in faults if f["kind"] == "sigterm")
    assert sum(1 for e in events if e["type"] == "job_end" and e["exitcode"] == 143) >= sigterms
    assert sum(1 for e in events if e["type"] == "job_start") == 1 + sigterms

    # The job recovered from every fault as promised, and ends bit-identical.
    assert doc["faulted"]["params_xxh3"], out[-6000:]
    assert doc["faulted"]["params_xxh3"] == doc["fault_free"]["params_xxh3"], out[-6000:]
    assert code == 0 and doc["ok"], "\n".join(doc["problems"]) + "\n" + out[-6000:]
