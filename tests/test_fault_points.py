"""Faults where a user's step really fails: at its start, after the last ``save()`` and before
the batch is fetched (a data-loading error, a bad sample, an input pipeline that hangs).

examples/user_ddp.py, 3 ranks on one launcher, ``--fault-at start``: rank 1 fails at the start
of step 14, after ``save(13)``. Until this was fixed, the snapshot copy thread of that step
waited up to 600 s for the next forward pass, and the interpreter's exit and the wrapper's
clean-up both joined it: a rank that raised there held its own exit, and the launcher killed
the survivors with it (or, without ``@ftrun.resilient``, the job stalled until the
coordinator's no-progress check); a rank hung outside any collective was named after 60 s,
and ``--hang-timeout`` killed the ranks waiting for it in the all-reduce with it.

Each case asserts that the fault fired, which processes survived (every rank the fault did
not kill keeps its pid), what the recovery event says, the step resumed from (13, or 12: see check_resumed), and that
the job ends bit-identical to the fault-free run. The whole matrix (fault kinds x points of a
step) is ``bench/fault_matrix.py``.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Procs, free_port, read_events

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
# 288 samples / 3 ranks / batch 8 = 12 steps per epoch, 2 epochs.
ARGS = ("--epochs", "2", "--samples", "288", "--batch-size", "8", "--hidden", "128")
STEP = 14
NOT_LEAVING = ("did not leave the training function", "did not exit within",
               "did not acknowledge")


def run_job(procs: Procs, tmp: Path, *args: str, launcher: tuple[str, ...] = (),
            script: str = SCRIPT, env: dict[str, str] | None = None
            ) -> tuple[str, list[dict[str, Any]], str]:
    """One launcher x three ranks; returns (params_xxh3, events, output)."""
    run_id = f"fp-{uuid.uuid4().hex[:8]}"
    proc: subprocess.Popen[str] = procs.ftrun(
        "--nnodes", "1", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
        "--max-restarts", "2", *launcher, script, *ARGS, "--fault-dir", str(tmp),
        "--pid-log", str(tmp), *args, env={"FTRUN_STATE_DIR": str(tmp / "state"),
                                           **(env or {})})
    code = procs.wait(proc, 240)
    out = procs.output(proc)
    assert code == 0, f"exit code {code}\n{out[-6000:]}"
    digests = re.findall(r"user-ddp: step=24 world=3 params_xxh3=([0-9a-f]+)", out)
    assert len(digests) == 1, out[-6000:]
    return digests[0], read_events(tmp / "state", run_id), out


def pids(tmp: Path) -> dict[int, set[str]]:
    return {r: {line.split()[1] for line in (tmp / f"pids-rank{r}.log").read_text()
                .splitlines()} for r in range(3)}


def check_resumed(out: str, tmp: Path, fault: str) -> None:
    assert (tmp / f"user-ddp-{fault}-rank1-step{STEP}").exists(), "the fault never fired"
    # Every rank resumed from the same step: 13, or 12 where the failing rank's snapshot of
    # 13 never staged (a snapshot takes the RNG states of the next forward pass, which the
    # fault came before: its copy is dropped as the rank leaves).
    steps = set(re.findall(r"rank \d resumed from step (\d+)", out))
    assert len(steps) == 1 and int(steps.pop()) in (STEP - 1, STEP - 2), out[-6000:]
    assert not [line for line in out.splitlines() if any(s in line for s in NOT_LEAVING)], \
        out[-6000:]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("fault-points-baseline")
    procs = Procs(tmp)
    try:
        digest, _, _ = run_job(procs, tmp)
    finally:
        procs.cleanup()
    return digest


def test_raise_at_the_start_of_a_step_keeps_every_process(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Rank 1 raises after save(13) (no thread of ftrun's holds it): on one node it keeps
    its process, and all three ranks restart in place in theirs."""
    digest, events, out = run_job(procs, tmp_path, "--fail-mode", "raise", "--fault-at",
                                  "start", "--kill-at-step", str(STEP), "--kill-rank", "1")
    check_resumed(out, tmp_path, "fault")
    assert [len(p) for p in pids(tmp_path).values()] == [1, 1, 1], pids(tmp_path)
    failures = [(e["rank"], e["exitcode"]) for e in events if e["type"] == "worker_failure"]
    assert failures == [(1, None)], failures  # reported failed, its process alive
    rec = [e for e in events if e["type"] == "recovery"]
    assert [(e["how"], e["new_processes"], e["kept"]) for e in rec] == \
        [("in_process", [], [0, 1, 2])], rec
    assert rec[0]["why"].startswith("rank 1 failed: RuntimeError"), rec
    assert digest == fault_free


def test_raise_at_the_start_of_a_step_without_the_decorator_restarts_at_once(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """The Snapshotter alone (no @ftrun.resilient): the raising rank exits on its own with
    its error (exit code 1, not killed), every rank restarts as a new process, and nothing
    waits for the coordinator's no-progress check."""
    digest, events, out = run_job(procs, tmp_path, "--plain", "--fail-mode", "raise",
                                  "--fault-at", "start", "--kill-at-step", str(STEP),
                                  "--kill-rank", "1")
    check_resumed(out, tmp_path, "fault")
    failed = [e for e in events if e["type"] == "worker_failure" and e["rank"] == 1]
    assert [e["exitcode"] for e in failed] == [1], failed
    assert not [e for e in events if e["type"] in ("hang_detected", "detection",
                                                   "directive_restart")], events[-20:]
    rec = [e for e in events if e["type"] == "recovery"]
    assert [e["how"] for e in rec] == ["new_process"], rec
    assert "does not restart in place" in rec[0]["fallback_reason"], rec
    assert [len(p) for p in pids(tmp_path).values()] == [2, 2, 2], pids(tmp_path)
    assert digest == fault_free


def test_a_rank_hung_outside_collectives_is_named_from_the_others_wait(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Rank 1 sleeps in Python at the start of step 14 (alive, idle, in no collective)
    while ranks 0 and 2 wait for it in DDP's all-reduce. With default flags the coordinator
    names it from their wait (its idleness rules out a long evaluation or checkpoint, which
    gets --busy-hang-timeout), and every rank restarts in place: no process is lost."""
    digest, events, out = run_job(procs, tmp_path, "--fail-mode", "hang", "--fault-at",
                                  "start", "--kill-at-step", str(STEP), "--kill-rank", "1")
    check_resumed(out, tmp_path, "fault")
    hangs = [e for e in events if e["type"] == "detection" and e["kind"] == "hang"]
    assert [(e["ranks"], e["evidence"]["reason"]) for e in hangs] == [([1], "behind")], hangs
    ev = hangs[0]["evidence"]
    assert ev["longest_wait_s"] < 60 and ev["idle_s"]["1"] >= ev["threshold_s"], ev
    rec = [e for e in events if e["type"] == "recovery"]
    assert [(e["how"], e["new_processes"]) for e in rec] == [("in_process", [])], rec
    assert rec[0]["detect_s"] >= ev["threshold_s"], rec  # from the wait's start, not 0
    assert [len(p) for p in pids(tmp_path).values()] == [1, 1, 1], pids(tmp_path)
    assert digest == fault_free


def test_hang_timeout_kills_the_culprit_not_the_ranks_waiting_for_it(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """--hang-timeout 4 with the coordinator only warning: rank 1, hung outside any
    collective, passes the timeout; ranks 0 and 2 have made no progress either, but they wait
    in the all-reduce (their collective monitor says since when): only rank 1 is killed."""
    digest, events, out = run_job(
        procs, tmp_path, "--fail-mode", "hang", "--fault-at", "start", "--kill-at-step",
        str(STEP), "--kill-rank", "1", launcher=("--hang-timeout", "4", "--on-hang", "warn"))
    check_resumed(out, tmp_path, "fault")
    hung = [e["rank"] for e in events if e["type"] == "hang_detected"]
    assert hung == [1], hung
    rec = [e for e in events if e["type"] == "recovery"]
    assert [(e["how"], e["new_processes"], e["kept"]) for e in rec] == \
        [("in_process", [1], [0, 2])], rec
    assert rec[0]["why"].startswith("rank 1 hung (no progress"), rec
    assert rec[0]["detect_s"] >= 4, rec
    assert [len(p) for p in pids(tmp_path).values()] == [1, 2, 1], pids(tmp_path)
    assert digest == fault_free


def test_a_killed_rank_is_replaced_by_a_parked_interpreter(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """FTRUN_PARKED_WORKERS=1: warm interpreters run the script up to its @ftrun.resilient
    function (imports, argument parsing) and wait there. Rank 1, SIGKILLed at the start of
    step 14, is replaced by one of them: it starts where a survivor restarts; the weights
    are bit-identical to the fault-free run (cold starts)."""
    digest, events, out = run_job(procs, tmp_path, "--fail-mode", "kill", "--fault-at",
                                  "start", "--kill-at-step", str(STEP), "--kill-rank", "1",
                                  env={"FTRUN_PARKED_WORKERS": "1"})
    check_resumed(out, tmp_path, "fault")
    assert [len(p) for p in pids(tmp_path).values()] == [1, 2, 1], pids(tmp_path)
    new_pid = sorted(pids(tmp_path)[1] - {min(pids(tmp_path)[1], key=int)}, key=int)
    starts = [e for e in events if e["type"] == "worker_warm_start" and e["local_rank"] == 1
              and str(e["pid"]) in new_pid]
    assert starts and starts[-1]["parked"] is True, [
        e for e in events if e["type"].startswith(("worker_", "warm", "parked"))]
    assert not [e for e in events if e["type"] == "parked_off"], events
    assert digest == fault_free


IDENTITY_FIRST = """
import os, runpy, sys
LOCAL = int(os.environ.get("LOCAL_RANK", "0"))  # the rank's identity, before the decorator
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def test_a_script_that_reads_its_rank_before_the_decorator_is_not_parked(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """A parked interpreter has no rank yet: a script that reads LOCAL_RANK at module level
    ends it (the read raises), the launcher says why and stops parking; the job runs from
    warm (not parked) interpreters and ends bit-identical. (Refused at the first start: no
    fault needed; a kill replaced from a parked interpreter is the test above.)"""
    script = tmp_path / "identity_first.py"
    script.write_text(IDENTITY_FIRST.format(script=SCRIPT))
    digest, events, out = run_job(procs, tmp_path, script=str(script),
                                  env={"FTRUN_PARKED_WORKERS": "1"})
    assert "the script reads LOCAL_RANK before its @ftrun.resilient function runs" in out, \
        out[-6000:]
    assert "parked workers off" in out and [e for e in events if e["type"] == "parked_off"]
    assert not [e for e in events if e["type"] == "worker_warm_start" and e["parked"]]
    assert digest == fault_free
