"""Benchmark: the rendezvous on etcd against c10d, for 2, 4 and 8 launchers (issue 19).

Each run starts N launchers on this machine (loopback, no namespaces), ``--nnodes N`` of one
rank each, whose worker is ``true`` (``--no-python``): the job is its rendezvous. The c10d
runs use a store hosted by the first launcher to bind the endpoint; the etcd runs a real
3-member etcd on loopback ports. Measured per launcher, from its ``rendezvous`` event: the
time its agent spent in torch's rendezvous (``duration_s``). The **last** launcher to join
waits for nobody: its time is what the backend costs (its joins, the syncs that see the
round complete); the first launcher's time also holds the others' start-up (interpreter,
torch import), which on a small machine dominates. Also recorded: start to the last
launcher's round complete (wall).

    .venv/bin/python bench/rendezvous.py [--sizes 2,4,8] [--rounds 1] [--output bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.testing import Procs, free_port, read_events  # noqa: E402
from ftrun.testing.etcd import EtcdCluster  # noqa: E402


def run_once(procs: Procs, tmp: Path, backend: str, n: int, endpoint: str) -> dict[str, Any]:
    run_id = f"rdzv-{backend}-{n}-{uuid.uuid4().hex[:6]}"
    state = tmp / "state"
    env = {"FTRUN_STATE_DIR": str(state)}
    t0 = time.time()
    nodes = [procs.ftrun("--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend",
                         backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                         "--max-restarts", "0", "--no-python", "true", env=env,
                         name=f"{run_id}.{i}") for i in range(n)]
    codes = [procs.wait(p, 300) for p in nodes]
    if codes != [0] * n:
        tail = "\n".join(procs.output(p)[-1500:] for p in nodes)
        raise RuntimeError(f"{backend} x{n}: exit codes {codes}\n{tail}")
    events = [e for e in read_events(state, run_id) if e["type"] == "rendezvous"]
    if len(events) != n:
        raise RuntimeError(f"{backend} x{n}: {len(events)} rendezvous events, not {n}")
    durations = sorted(e["duration_s"] for e in events)
    return {"backend": backend, "launchers": n, "last_s": durations[0],
            "median_s": statistics.median(durations), "first_s": durations[-1],
            "wall_s": max(e["ts"] for e in events) - t0, "load": os.getloadavg()[0]}


def report(rows: list[dict[str, Any]], sizes: list[int], rounds: int) -> str:
    lines = [
        "", "## Rendezvous: etcd vs c10d, 2 to 8 launchers (issue 19)", "",
        f"`python bench/rendezvous.py --sizes {','.join(map(str, sizes))} --rounds {rounds}` "
        f"on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs "
        f"({platform.machine()}), loopback, shared machine: N launchers of one `true` worker "
        "each; c10d on a launcher-hosted store, etcd on 3 members (etcd 3.4). Per launcher, "
        "the time in torch's rendezvous (its `rendezvous` event).", "",
        "| backend | launchers | last to join | median | first to join | start → last round "
        "complete | load (1 min) |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["launchers"], r["backend"])):
        lines.append(f"| {r['backend']} | {r['launchers']} | {r['last_s']:.2f} s | "
                     f"{r['median_s']:.2f} s | {r['first_s']:.2f} s | {r['wall_s']:.1f} s | "
                     f"{r['load']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,4,8", help="launcher counts, comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="runs of each backend and size")
    p.add_argument("--output", help="append the results to this Markdown file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-rdzv-") as d:
        tmp = Path(d)
        procs = Procs(tmp)
        try:
            with EtcdCluster(tmp / "etcd") as cluster:
                for _ in range(args.rounds):
                    for n in sizes:
                        for backend in ("c10d", "etcd"):
                            endpoint = cluster.endpoints if backend == "etcd" \
                                else f"127.0.0.1:{free_port()}"
                            row = run_once(procs, tmp, backend, n, endpoint)
                            print(json.dumps(row), flush=True)
                            rows.append(row)
        finally:
            procs.cleanup()
    text = report(rows, sizes, args.rounds)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
