"""Jobs on ``--rdzv-backend etcd``: 2 launchers x 2 ranks of examples/user_ddp.py on a real
3-member etcd cluster, weights bit-identical to the fault-free run.

One module-scoped cluster and one fault-free run serve both faulted runs:

- a rank killed mid-training. Checked: the fault fired; the launchers elected one
  coordinator through etcd (one ran it, the other found it there); and ``ftrun status`` from a
  shell that has no job file (an empty state directory, the secret in FTRUN_SECRET) finds the
  coordinator through etcd and answers while the job runs;
- etcd's quorum lost mid-training (2 of its 3 members stopped) and back. Checked: the ranks
  train on while it is lost, every launcher says so, the coordinator steps down when its
  lease can no longer be renewed (no commits), and once the members are back a coordinator
  of a new term commits again, ``ftrun status`` finds it, and the job ends bit-identical.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, Procs
from test_etcd import require_etcd

from ftrun.launcher import etcd
from ftrun.testing.etcd import EtcdCluster
from ftrun.testing.procs import read_events, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
ARGS = ("--epochs", "2", "--samples", "256", "--batch-size", "8", "--hidden", "128")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as c:
        yield c


def start_job(procs: Procs, tmp: Path, cluster: EtcdCluster, run_id: str, secret: str,
              *script_args: str, **env_vars: str) -> list[subprocess.Popen[str]]:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
              "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", run_id,
              "--max-restarts", "2", SCRIPT, *ARGS, "--fault-dir", str(tmp), "--pid-log",
              str(tmp), *script_args]
    env = {"FTRUN_STATE_DIR": str(tmp / "state"), "FTRUN_SECRET": secret, **env_vars}
    return [procs.ftrun(*common, env=env, name=f"node{i}") for i in range(2)]


def finish(procs: Procs, nodes: list[subprocess.Popen[str]]) -> tuple[str, str]:
    codes = [procs.wait(p, 240) for p in nodes]
    out = "\n".join(procs.output(p) for p in nodes)
    assert codes == [0, 0], f"exit codes {codes}\n{out[-6000:]}"
    digests = re.findall(r"user-ddp: step=16 world=4 params_xxh3=([0-9a-f]+)", out)
    assert len(digests) == 1, out[-6000:]
    return digests[0], out


def status_through_etcd(tmp: Path, cluster: EtcdCluster, run_id: str,
                        secret: str) -> dict | None:
    """``ftrun status RUN_ID --etcd ... --json`` from a state directory without the job."""
    empty = tmp / "login-shell-state"
    empty.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "ftrun", "status", run_id, "--etcd", cluster.endpoints,
         "--json", "--state-dir", str(empty)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "FTRUN_SECRET": secret})
    if done.returncode not in (0, 3) or not done.stdout.strip():
        return None
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def fault_free(cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The weights' digest of the job run without a fault."""
    base = tmp_path_factory.mktemp("baseline")
    procs = Procs(base)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FTRUN_SNAPSHOT_WAIT", "60")  # as the exact_steps fixture
            digest, _ = finish(procs, start_job(procs, base, cluster,
                                                f"etcd-{uuid.uuid4().hex[:8]}",
                                                secrets.token_hex(16)))
        yield digest
    finally:
        procs.cleanup()


def test_etcd_job_killed_rank_ends_bit_identical(procs: Procs, tmp_path: Path,
                                                 cluster: EtcdCluster, fault_free: str) -> None:
    secret = secrets.token_hex(16)
    run_id = f"etcd-{uuid.uuid4().hex[:8]}"
    nodes = start_job(procs, tmp_path, cluster, run_id, secret,
                      "--kill-at-step", "11", "--kill-rank", "2")
    # While it runs, a login shell with no job file finds the coordinator through etcd.
    doc = wait_for(lambda: status_through_etcd(tmp_path, cluster, run_id, secret), 120,
                   "ftrun status through etcd", interval_s=0.5)
    assert doc["run_id"] == run_id, doc
    digest, out = finish(procs, nodes)
    assert (tmp_path / "user-ddp-fault-rank2-step11").exists(), "the fault never fired"
    assert "killing rank 2 in step 11" in out
    # One launcher ran the coordinator; the other found it in etcd.
    assert len(re.findall(r"holds the coordinator role of job " + run_id, out)) == 1, out[-4000:]
    assert len(re.findall(r"found in etcd", out)) == 1, out[-4000:]
    steps = set(re.findall(r"rank \d resumed from step (\d+)", out))
    assert len(steps) == 1 and int(steps.pop()) in (10, 9), out[-6000:]
    assert digest == fault_free
    assert_no_key_left(cluster, run_id)


def assert_no_key_left(cluster: EtcdCluster, run_id: str) -> None:
    """The job ended well: its last launcher out deleted its keys, but for the mark that it
    ended (under a lease)."""
    left = etcd.EtcdClient(cluster.endpoints).get_prefix(etcd.key_prefix(run_id))
    assert [kv.key.decode() for kv in left] == [etcd.ended_key(run_id)], \
        [kv.key for kv in left]
    assert left[0].lease


def _step(out: Path, rank: int) -> int:
    """The last step rank ``rank`` logged (0 before its first)."""
    path = out / f"pids-rank{rank}.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return int(lines[-1].split()[0]) if lines else 0


def test_etcd_quorum_lost_the_ranks_train_on_and_commits_resume_once_it_is_back(
        procs: Procs, tmp_path: Path, cluster: EtcdCluster, fault_free: str) -> None:
    secret = secrets.token_hex(16)
    run_id = f"quorum-{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    # 2 s a step: 32 s of training, the quorum's loss and return in the middle of it. A step
    # never waits for its snapshot buffer (ftrun's default; the module's exact_steps makes
    # it wait): without commits, buffers are not released and snapshots are skipped.
    nodes = start_job(procs, tmp_path, cluster, run_id, secret, "--step-sleep", "2",
                      FTRUN_SNAPSHOT_WAIT="0")

    def step() -> int:
        return min(_step(tmp_path, r) for r in range(4))

    wait_for(lambda: step() >= 2, 150, "every rank at step 2", interval_s=0.1)
    before = wait_for(lambda: status_through_etcd(tmp_path, cluster, run_id, secret), 60,
                      "ftrun status through etcd", interval_s=0.5)
    old_term = before["coordinator"]["term"]

    def stepped_down() -> list[dict]:
        return [e for e in read_events(state, run_id)
                if e["type"] == "coordinator_stepped_down" and e.get("term") == old_term]

    try:
        for i in (1, 2):
            cluster.stop_member(i)
        lost_at = step()
        # Its lease can no longer be renewed: the coordinator steps down (no commits from
        # here), and the ranks go on training.
        down = wait_for(stepped_down, 60, "the coordinator to step down", interval_s=0.2)
        assert "lease" in down[0]["reason"], down
        assert lost_at < 12, lost_at  # (the job is still mid-training)
        trained = step()
        wait_for(lambda: step() >= trained + 2, 60, "the ranks to train on without etcd's "
                 "quorum", interval_s=0.2)
        without_quorum = [procs.output(p) for p in nodes]
    finally:
        for i in (1, 2):
            if cluster.procs[i] is None:
                cluster.start_member(i)
    wait_for(cluster.healthy, 30, "etcd members healthy again")
    back_at = step()

    def committing_again() -> dict | None:
        """The status once a coordinator of a new term has committed a step taken after
        the quorum came back."""
        doc = status_through_etcd(tmp_path, cluster, run_id, secret)
        if not doc or doc["coordinator"].get("term", 0) <= old_term:
            return None
        return doc if ((doc.get("snapshots") or {}).get("committed_step") or 0) > back_at \
            else None

    wait_for(committing_again, 90, "a new coordinator committing", interval_s=0.5)
    digest, out = finish(procs, nodes)
    assert digest == fault_free
    assert all("is unreachable" in text and "keeps training on its current world" in text
               for text in without_quorum), "\n".join(t[-3000:] for t in without_quorum)
    assert all("is reachable again" in procs.output(p) for p in nodes), out[-6000:]
    assert_no_key_left(cluster, run_id)
