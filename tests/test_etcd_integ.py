"""A job on ``--rdzv-backend etcd``: 2 launchers x 2 ranks of examples/user_ddp.py on a real
3-member etcd cluster, a rank killed mid-training, weights bit-identical to the fault-free run.

One module-scoped cluster serves both runs. Checked in the faulted run: the fault fired; the
launchers elected one coordinator through etcd (one ran it, the other found it there); and
``ftrun status`` from a shell that has no job file (an empty state directory, the secret in
FTRUN_SECRET) finds the coordinator through etcd and answers while the job runs.
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

from ftrun.testing.etcd import EtcdCluster
from ftrun.testing.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
ARGS = ("--epochs", "2", "--samples", "256", "--batch-size", "8", "--hidden", "128")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as c:
        yield c


def start_job(procs: Procs, tmp: Path, cluster: EtcdCluster, run_id: str, secret: str,
              *script_args: str) -> list[subprocess.Popen[str]]:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
              "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", run_id,
              "--max-restarts", "2", SCRIPT, *ARGS, "--fault-dir", str(tmp), "--pid-log",
              str(tmp), *script_args]
    env = {"FTRUN_STATE_DIR": str(tmp / "state"), "FTRUN_SECRET": secret}
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


def test_etcd_job_killed_rank_ends_bit_identical(procs: Procs, tmp_path: Path,
                                                 cluster: EtcdCluster) -> None:
    secret = secrets.token_hex(16)
    base = tmp_path / "baseline"
    base.mkdir()
    fault_free, _ = finish(procs, start_job(procs, base, cluster, f"etcd-{uuid.uuid4().hex[:8]}",
                                            secret))

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
