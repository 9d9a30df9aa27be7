"""A script written the way users write them, 4 ranks on 2 launchers, ends bit-identical.

examples/user_ddp.py is stock PyTorch with default arguments (DDP, DataLoader over a shuffled
DistributedSampler with set_epoch, dropout, AdamW, LambdaLR warm-up/cosine, gradient
clipping) plus ftrun's Snapshotter and ``@ftrun.resilient``. Killing one rank mid-epoch (and
at an epoch boundary) must not change the final weights, and only that rank gets a new
process (the others restart in place). Each of these was a real source of divergence:

- DDP rebuilds its gradient buckets after its first iteration, so a restarted process would
  reduce its first step with another layout (4 ranks sum in another order);
- a new DataLoader iterator draws a seed from the global RNG, shifting every dropout mask
  after a mid-epoch resume.

A bit flipped in one replica's parameters (silent data corruption) is found at that step's
snapshot, the step is never restored, and the job also ends bit-identical; the fault-free run
has no such finding.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, ROOT, Procs, free_port, read_events

# Each case checks the step it resumes from (mid-epoch, at an epoch boundary): no snapshot
# may be skipped. The default (never wait, skip) runs bit-identical in
# tests/test_snapshot_stall.py.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
# 256 samples / 4 ranks / batch 8 = 8 steps per epoch, 2 epochs.
ARGS = ("--epochs", "2", "--samples", "256", "--batch-size", "8", "--hidden", "128")


def run_job(procs: Procs, tmp: Path, *script_args: str) -> tuple[str, str, str]:
    """Two launchers x two ranks; returns (params_xxh3, run id, combined output)."""
    run_id = f"user-{uuid.uuid4().hex[:8]}"
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
              "--max-restarts", "2", SCRIPT, *ARGS, "--fault-dir", str(tmp), "--pid-log",
              str(tmp), *script_args]
    env = {"FTRUN_STATE_DIR": str(tmp / "state")}
    nodes: list[subprocess.Popen[str]] = [
        procs.ftrun(*common, env=env, name=f"node{i}") for i in range(2)]
    codes = [procs.wait(p, 240) for p in nodes]
    out = "\n".join(procs.output(p) for p in nodes)
    assert codes == [0, 0], f"exit codes {codes}\n{out[-6000:]}"
    digests = re.findall(r"user-ddp: step=16 world=4 params_xxh3=([0-9a-f]+)", out)
    assert len(digests) == 1, out[-6000:]
    return digests[0], run_id, out


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("user-ddp-baseline")
    procs = Procs(tmp)
    try:
        digest, run_id, _ = run_job(procs, tmp)
    finally:
        procs.cleanup()
    # Zero false findings: the DDP replicas (dropout, default arguments) agreed at every step.
    found = [e for e in read_events(tmp / "state", run_id) if e["type"] == "corruption_detected"]
    assert not found, f"silent-corruption findings in a healthy run: {found}"
    return digest


@pytest.mark.parametrize("loader, kill_step, resumed", [
    ("sampler", 11, 10),   # mid-epoch: the script skips the trained batches of epoch 1
    pytest.param("sampler", 9, 8, marks=FULL_MATRIX),  # right after an epoch boundary
    ("stateful", 13, 12),  # torchdata's StatefulDataLoader restores its own position
])
def test_killed_rank_ends_bit_identical(procs: Procs, tmp_path: Path, fault_free: str,
                                        loader: str, kill_step: int, resumed: int) -> None:
    digest, _, out = run_job(procs, tmp_path, "--loader", loader,
                             "--kill-at-step", str(kill_step), "--kill-rank", "2")
    assert (tmp_path / f"user-ddp-fault-rank2-step{kill_step}").exists(), "the fault never fired"
    assert f"killing rank 2 in step {kill_step}" in out
    # Every rank resumed from the same step: the last one before the kill, or (replication
    # is on by default: a rank's snapshot of step S-1 waits until S-2 has its replicas, and
    # the killed rank may die before its copy of S-1 began) the one before it.
    steps = set(re.findall(r"rank \d resumed from step (\d+)", out))
    assert len(steps) == 1 and int(steps.pop()) in (resumed, resumed - 1), out[-6000:]
    # The script runs under @ftrun.resilient: only the killed rank got a new process, the
    # three others, on both launchers, restarted in place.
    pids = {r: {line.split()[1] for line in (tmp_path / f"pids-rank{r}.log").read_text()
                .splitlines()} for r in range(4)}
    assert [len(pids[r]) for r in range(4)] == [1, 1, 2, 1], pids
    assert digest == fault_free


def test_rank_stopped_in_its_first_step_is_named_by_the_coordinator(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Rank 1 freezes (SIGSTOP) in step 1, a fraction of a second after the Snapshotter
    started its collective monitor, while the others wait for it in DDP's all-reduce. The
    coordinator names it (a hang: silent) and has its launcher kill it; the job restarts and
    ends bit-identical. Its first report used to be due 0.5 s after the monitor's start: the
    coordinator never heard of rank 1, named nobody, and the launcher's own stopped-rank
    watch killed it 10 s later."""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "stop",
                                  "--kill-at-step", "1", "--kill-rank", "1")
    assert (tmp_path / "user-ddp-fault-rank1-step1").exists(), "the fault never fired"
    assert "stopping rank 1 in step 1" in out
    events = read_events(tmp_path / "state", run_id)
    hangs = [e for e in events if e["type"] == "detection" and e["kind"] == "hang"]
    assert [(e["ranks"], e["evidence"]["reason"], e["action"]) for e in hangs] == \
        [([1], "silent", "restart")], hangs
    acked = [e for e in events if e["type"] == "directive_acked"
             and e.get("action") == "restart"]
    assert acked, f"the restart order was never carried out: {events[-20:]}"
    assert digest == fault_free


def test_a_flipped_bit_is_named_never_restored_and_the_job_ends_bit_identical(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Silent data corruption: rank 1 flips one bit of its first parameter after the
    optimizer step of step 3 and trains on, its replica now different from the three
    others. The coordinator compares the replicas' digests (from the snapshot's chunk hashes)
    at that step's snapshot, names rank 1, refuses the step and, under the default
    ``--on-corruption restart``, restarts it; the job resumes from the newest step the
    replicas agreed on and ends bit-identical (docs/snapshots.md, Silent data corruption)."""
    flip = 3
    # The flipped rank trains on (nothing fails): the steps after the flip are slowed so that
    # the restart order reaches it before the job ends (training here takes milliseconds a
    # step; a restart that came after the end would re-run the job's last steps).
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "bitflip",
                                  "--kill-at-step", str(flip), "--kill-rank", "1",
                                  "--step-sleep", "0.4")
    assert (tmp_path / f"user-ddp-fault-rank1-step{flip}").exists(), "the fault never fired"
    assert f"flipped a bit of 0.weight in rank 1 in step {flip}" in out
    events = read_events(tmp_path / "state", run_id)
    found = [e for e in events if e["type"] == "corruption_detected"]
    # Found at the snapshot of the very step; rank 1 named by the majority of 4 replicas.
    assert [(e["step"], e["ranks"], e["majority"], e["replicas"], e["action"])
            for e in found] == [(flip, [1], True, 4, "restart")], found
    assert found[0]["tensors"][0].startswith("/model/0.weight"), found
    restarts = [e for e in events if e["type"] == "directive" and e["action"] == "restart"
                and "corruption" in e["data"]["reason"]]
    assert [e["data"]["ranks"] for e in restarts] == [[1]], restarts
    # Every rank resumed from a step the replicas agreed on, before the flip.
    steps = set(re.findall(r"rank \d resumed from step (\d+)", out))
    assert len(steps) == 1 and int(steps.pop()) in (flip - 1, flip - 2), out[-6000:]
    assert digest == fault_free
