"""Benchmark: losing the coordinator's host vs losing an ordinary host (``--rdzv-backend etcd``).

On network namespaces (``ftrun.testing.netns``: 4 hosts, 3 training examples/user_ddp.py
with one rank each, the 4th a spare) with a real 3-member etcd on the root side of their
bridge, each round runs the job twice and kills, at step ``--kill-at``, one training host:

- **ordinary**: a host whose launcher does not hold the coordinator role;
- **coordinator**: the host whose launcher holds it (its lease runs out, another launcher
  takes the role and every survivor moves to it).

Measured from the kill: the first step trained by the new world (the first step any rank
logs after the round that follows the kill started its workers), and for the coordinator
case when the first survivor moved to the new coordinator. Each faulted run must end with
the fault-free run's ``params_xxh3`` (one fault-free run per invocation). The goal (issue
19): coordinator-host loss no more than 1.5x an ordinary host's.

    sudo .venv/bin/python bench/failover.py [--rounds 2] [--output bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.launcher import etcd  # noqa: E402
from ftrun.testing import read_events, wait_for  # noqa: E402
from ftrun.testing.etcd import USER_DDP_DIGEST, EtcdCluster, user_ddp_on_etcd  # noqa: E402
from ftrun.testing.netns import Cluster  # noqa: E402


def _digest(c: Cluster, nodes: list[Any]) -> str:
    [digest] = re.findall(USER_DDP_DIGEST, c.succeed(nodes, 300), re.M)
    return digest


def _steps(out: Path) -> list[tuple[int, float]]:
    """(step, wall time) of every step every rank logged."""
    rows = []
    for path in out.glob("pids-rank*.log"):
        for line in path.read_text().splitlines():
            step, _, t = line.split()
            rows.append((int(step), float(t)))
    return rows


def run_case(c: Cluster, endpoints: str, state_dir: Path, case: str, kill_at: int,
             tmp: Path) -> dict[str, Any]:
    client = etcd.EtcdClient(endpoints, timeout_s=2)
    run_id = f"{case}-{uuid.uuid4().hex[:6]}"
    out = tmp / run_id
    nodes = user_ddp_on_etcd(c, endpoints, run_id, [0, 1, 2], out)

    def step() -> int:  # the newest step any rank logged
        return max((s for s, _ in _steps(out)), default=0)

    wait_for(lambda: step() >= 1, 300, "training", interval_s=0.2)
    nodes += user_ddp_on_etcd(c, endpoints, run_id, [3], out)  # the spare
    holder_rec = etcd.read_coordinator(client, run_id)
    assert holder_rec is not None
    holder = c.namespaces.index(holder_rec.host)
    wait_for(lambda: step() >= kill_at, 300, f"step {kill_at}", interval_s=0.1)
    victim = holder if case == "coordinator" else next(h for h in (0, 1, 2) if h != holder)
    t_kill = time.time()
    c.kill_host(victim)
    digest = _digest(c, [p for p in nodes if p.host != victim])
    events = read_events(state_dir, run_id)
    starts = [e["ts"] for e in events if e["type"] == "workers_started" and e["ts"] > t_kill]
    first = min(t for _, t in _steps(out) if starts and t > min(starts))
    moves = [e["ts"] for e in events if e["type"] == "coordinator_failover"]
    return {"case": case, "digest": digest, "resumed_s": first - t_kill,
            "failover_s": (min(moves) - t_kill) if moves else None,
            "load": os.getloadavg()[0]}


def report(rows: list[dict[str, Any]], reference: str, kill_at: int, rounds: int) -> str:
    by = {case: [r for r in rows if r["case"] == case] for case in ("ordinary", "coordinator")}
    med = {case: statistics.median(r["resumed_s"] for r in rs) for case, rs in by.items()}
    lines = [
        "", "## Coordinator-host loss vs ordinary host loss (etcd)", "",
        f"`python bench/failover.py --rounds {rounds}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs: "
        "examples/user_ddp.py on 3 namespace hosts + a spare, one rank each (gloo, CPU), "
        f"`--rdzv-backend etcd` (3 members), a training host killed at step {kill_at}.",
        "", "| case | round | kill → new world's first step | kill → first launcher on the "
        "new coordinator | load (1 min) | bit-identical |", "|---|---|---|---|---|---|"]
    for case, rs in by.items():
        for i, r in enumerate(rs):
            fo = f"{r['failover_s']:.1f} s" if r["failover_s"] is not None else "—"
            lines.append(f"| {case} | {i + 1} | {r['resumed_s']:.1f} s | {fo} | "
                         f"{r['load']:.1f} | {'yes' if r['digest'] == reference else 'NO'} |")
    ratio = med["coordinator"] / med["ordinary"]
    lines += ["", f"- Median kill → first step: ordinary {med['ordinary']:.1f} s, coordinator's "
              f"host {med['coordinator']:.1f} s: ratio **{ratio:.2f}** (goal ≤ 1.5)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1, help="runs of each case")
    p.add_argument("--kill-at", type=int, default=8, help="step at which the host is killed")
    p.add_argument("--output", help="append the results to this Markdown file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-failover-") as d:
        tmp = Path(d)
        state_dir = tmp / "state"
        os.environ["FTRUN_STATE_DIR"] = str(state_dir)
        (tmp / "hosts").mkdir()
        with Cluster(4, tmp / "hosts", state_dir) as c:
            root_addr = f"{c.subnet}.254"
            subprocess.run(["ip", "addr", "add", f"{root_addr}/24", "dev", c.bridge],
                           check=True)
            with EtcdCluster(tmp / "etcd", host=root_addr) as cluster:
                endpoints = cluster.endpoints
                reference = _digest(c, user_ddp_on_etcd(c, endpoints, f"ref-{uuid.uuid4().hex[:6]}",
                                            [0, 1, 2], tmp / "ref"))
                rows = []
                for _ in range(args.rounds):
                    for case in ("ordinary", "coordinator"):
                        row = run_case(c, endpoints, state_dir, case, args.kill_at, tmp)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    text = report(rows, reference, args.kill_at, args.rounds)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text)
    return 0 if all(r["digest"] == reference for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
