"""Persistence end to end: two launchers of two ranks each on localhost, the real ftrun.

Every way a step gets to disk (every N steps, by interval, SIGUSR1, SIGTERM, the end of the
job) must leave only complete steps, the same on every node; a requeued job resumes from the
final step; a corrupt newest step makes the next job resume from the older complete one, with
the fault-free weights; a directory of nothing but corrupt steps stops the job with a clear
error, unless --start-fresh.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, ROOT, TRAIN, Procs, free_port, read_events, result_line, wait_for

from ftrun.faults import corrupt_persisted
from ftrun.snapshot import persist
from ftrun.snapshot import segment as shm

# These tests check exact steps (resumed from, persisted): no snapshot may be skipped.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

STEPS = "10"
MODEL = ("--layers", "1", "--dim", "16")


def two_nodes(procs: Procs, persist_dir: Path, *ftrun_args: str, train_args: tuple[str, ...] = (),
              state_dir: Path | None = None,
              extra_env: dict[str, str] | None = None) -> tuple[str, list[subprocess.Popen[str]]]:
    run_id = f"persist-{uuid.uuid4().hex[:8]}"
    env = {**({"FTRUN_STATE_DIR": str(state_dir)} if state_dir is not None else {}),
           **(extra_env or {})} or None
    port = free_port()
    argv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--persist-dir", str(persist_dir), *ftrun_args,
            TRAIN, "--steps", STEPS, *MODEL, *train_args]
    return run_id, [procs.ftrun(*argv, env=env, name=f"node{i}") for i in range(2)]


def outputs(procs: Procs, nodes: list[subprocess.Popen[str]]) -> str:
    return "".join(procs.output(n) for n in nodes)


def succeed(procs: Procs, nodes: list[subprocess.Popen[str]], result: Path) -> dict:
    for node in nodes:
        code = procs.wait(node, 240)
        assert code == 0, f"exit {code}:\n{procs.output(node)[-4000:]}"
    doc = json.loads(result.read_text())
    assert doc["params_xxh3"] in result_line(outputs(procs, nodes))
    return doc


def targets(state_dir: Path, run_id: str) -> list[dict]:
    return [e for e in read_events(state_dir, run_id) if e["type"] == "persist_target"]


def newest_committed(out: str) -> int:
    """The newest step every rank held verified when the stores stopped (from their logs):
    the job's newest committed step, since a rank overwrites a step only after the next one
    committed."""
    held = dict(re.findall(r"rank(\d+)=([\d,]*)", " ".join(
        re.findall(r"stopping; verified steps held here: (.*)", out))))
    assert sorted(held) == ["0", "1", "2", "3"], held
    common = set.intersection(*({int(s) for s in v.split(",") if s} for v in held.values()))
    return max(common)


def check_all_complete(ckpt: Path) -> list[int]:
    """Every step directory is complete on all 4 ranks (also for `ftrun inspect`)."""
    steps = persist.list_steps(ckpt)
    for s in steps:
        assert s.complete and s.world_size == 4, (s.step, s.why_incomplete)
    inspected = subprocess.run([sys.executable, "-m", "ftrun", "inspect", str(ckpt), "--json"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert [(s["step"], s["status"]) for s in report["steps"]] == [
        (s.step, "complete") for s in steps]
    return [s.step for s in steps]


@pytest.fixture(scope="module")
def first_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fault-free job persisting every 4 steps and at its end: its weights are the baseline,
    its persist dir the starting point of the restore tests, which need two complete steps.
    Each step waits for its snapshot buffer (as the exact_steps fixture has it): a skipped
    snapshot, while the previous step waits for its replica, once left the first commit the
    coordinator saw at step 10, and so only the final step on disk."""
    tmp = tmp_path_factory.mktemp("persist-first")
    procs = Procs(tmp)
    state_dir, ckpt = tmp / "state", tmp / "ckpt"
    try:
        run_id, nodes = two_nodes(procs, ckpt, "--persist-every", "4", "--persist-keep", "10",
                                  train_args=("--result", str(tmp / "r.json")),
                                  state_dir=state_dir,
                                  extra_env={"FTRUN_SNAPSHOT_WAIT": "60"})
        doc = succeed(procs, nodes, tmp / "r.json")
        return {"params_xxh3": doc["params_xxh3"], "ckpt": ckpt, "out": outputs(procs, nodes),
                "targets": targets(state_dir, run_id)}
    finally:
        procs.cleanup()


def test_every_n_steps_and_the_end_of_the_job_write_complete_steps(first_job: dict) -> None:
    made = first_job["targets"]
    # Each scheduled target is the first committed step past a multiple of 4 (a due step is
    # skipped on every node alike while a write is still running: the disk is behind).
    assert made[0]["step"] >= 4 and len(made) >= 2
    previous = 0
    for t in made[:-1]:
        assert t["reason"] == "every 4 steps" and t["step"] // 4 > previous // 4, made
        previous = t["step"]
    final = made[-1]
    assert final["final"] and final["reason"] == "end of job"
    assert final["step"] == newest_committed(first_job["out"])
    on_disk = check_all_complete(first_job["ckpt"])
    assert on_disk == sorted({t["step"] for t in made}, reverse=True)
    # Written once by each node (as the final target, or already as a scheduled one).
    assert len(re.findall(rf"persisting step {final['step']}( \(final\))?:",
                          first_job["out"])) == 2


@FULL_MATRIX  # ~110 s; a requeued job resuming from its final step: test_slurm_examples (real Slurm)
def test_interval_sigusr1_and_sigterm_then_the_requeued_job_resumes_from_the_final_step(
        procs: Procs, state_dir: Path, tmp_path: Path, first_job: dict) -> None:
    ckpt = tmp_path / "ckpt"
    run_id, nodes = two_nodes(procs, ckpt, "--persist-interval", "1", "--persist-keep", "100",
                              train_args=("--step-sleep", "1.5"))
    made = lambda: targets(state_dir, run_id)  # noqa: E731
    wait_for(lambda: any(t["reason"] == "interval 1 s" for t in made()), 180,
             "a persist target by interval")
    # A signal to one launcher: every node writes the step it picked.
    nodes[1].send_signal(signal.SIGUSR1)
    signalled = wait_for(lambda: [t for t in made() if t["reason"] == "SIGUSR1"], 60,
                         "a persist target by SIGUSR1")[0]
    wait_for(lambda: any(t["step"] > signalled["step"] for t in made()), 60,
             "a later persist target")
    # Slurm preemption: every launcher gets SIGTERM at about the same time.
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    for node in nodes:
        code = procs.wait(node, 180)
        assert code == 128 + signal.SIGTERM, procs.output(node)[-4000:]
    assert "ftrun-example: step=" not in outputs(procs, nodes), "the job ended before SIGTERM"
    assert not shm.list_segments(shm.job_prefix(run_id))

    final = made()[-1]
    assert final["final"] and final["reason"] == "end of job"
    assert final["step"] == newest_committed(outputs(procs, nodes))
    assert final["step"] > signalled["step"] > 0
    on_disk = check_all_complete(ckpt)
    assert on_disk == sorted({t["step"] for t in made() if t["step"] > 0}, reverse=True)
    assert on_disk[0] == final["step"]

    # The requeued job resumes from that final step and ends with the fault-free weights.
    result = tmp_path / "r.json"
    _, again = two_nodes(procs, ckpt, train_args=("--result", str(result)))
    doc = succeed(procs, again, result)
    assert doc["resumed_from"] == [final["step"]]
    assert doc["params_xxh3"] == first_job["params_xxh3"]


def test_a_corrupt_newest_step_is_skipped_for_the_older_complete_one(
        procs: Procs, state_dir: Path, tmp_path: Path, first_job: dict) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_job["ckpt"], ckpt)
    newest, older = check_all_complete(ckpt)[:2]
    hit = corrupt_persisted(str(ckpt), newest, 2)  # a rank of the second node
    result = tmp_path / "r.json"
    _, nodes = two_nodes(procs, ckpt, train_args=("--result", str(result)))
    doc = succeed(procs, nodes, result)
    assert doc["resumed_from"] == [older]
    assert doc["params_xxh3"] == first_job["params_xxh3"]
    out = outputs(procs, nodes)
    assert (f"persisted step {newest} in {ckpt} is skipped: it fails verification on rank(s) 2"
            in out)
    assert hit.key in out  # the failing rank names the tensor


def test_no_usable_step_stops_the_job_unless_start_fresh(
        procs: Procs, state_dir: Path, tmp_path: Path, first_job: dict) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_job["ckpt"], ckpt)
    steps = check_all_complete(ckpt)
    for i, step in enumerate(steps):
        corrupt_persisted(str(ckpt), step, i % 4)
    run_id, nodes = two_nodes(procs, ckpt, "--max-restarts", "1")
    for node in nodes:
        assert procs.wait(node, 240) == 1, procs.output(node)[-4000:]
    out = outputs(procs, nodes)
    assert f"--persist-dir {ckpt} holds {len(steps)} persisted step(s), but none can be " \
           "restored" in out
    for i, step in enumerate(steps):
        assert f"step {step}: fails verification on rank {i % 4}: " in out
    assert "pass --start-fresh" in out and "ftrun-example: step=" not in out
    # The launchers give up after --max-restarts (the workers start twice), saying why.
    starts = [e for e in read_events(state_dir, run_id) if e["type"] == "workers_started"]
    assert len(starts) == 2 * 2
    assert "RestoreError" in out

    result = tmp_path / "r.json"
    _, fresh = two_nodes(procs, ckpt, "--start-fresh", train_args=("--result", str(result)))
    doc = succeed(procs, fresh, result)
    assert doc["resumed_from"] == []
    assert doc["params_xxh3"] == first_job["params_xxh3"]
    assert "starting from step 0" in outputs(procs, fresh)
