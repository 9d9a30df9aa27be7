"""Benchmark: every fault kind at every point of a step, one job each, with what survived.

One command::

    .venv/bin/python bench/fault_matrix.py [--kinds raise,kill,...] [--points start,...]
        [--output bench/RESULTS.md]

The job is ``examples/user_ddp.py`` (``@ftrun.resilient``, a ``Snapshotter``, DDP defaults,
shuffled ``DistributedSampler``, AdamW, warm-up, dropout, clipping; gloo on CPU), one launcher
x ``--nproc`` ranks, c10d rendezvous, default flags but ``--max-restarts 2``. Rank
``--fail-rank`` fails once in step ``--fail-at-step`` (``--fail-mode KIND --fault-at POINT``):

- kinds: ``raise`` (an exception), ``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``hang`` (a sleep
  in Python, outside any collective), ``bitflip`` (one bit of a parameter: silent
  corruption, the rank trains on), ``copy`` (SIGKILL from the snapshot's copy thread while the
  step's snapshot is half written; one point only);
- points: ``start`` (after the previous ``save()``, before the batch is fetched),
  ``forward``, ``backward`` (before ``backward()``), ``optimizer`` (before
  ``optimizer.step()``), ``after-step`` (after it, before ``save()``).

Each cell reports: whether the fault fired (its marker), fault -> next step (every rank
logged a step after the fault), how the job recovered (the launcher's ``recovery`` events),
which ranks kept their process (pids from ``--pid-log``), the step resumed from, and whether
the final weights equal the fault-free run's. Not covered here: a hang inside a collective
and a lost node (tests/test_node_loss.py, bench/inprocess.py --node-loss).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ftrun.testing import free_port, kill_sessions, work_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "user_ddp.py")
DIGEST = re.compile(r"user-ddp: step=\d+ world=\d+ params_xxh3=([0-9a-f]+)")
KINDS = ("raise", "kill", "stop", "hang", "bitflip", "copy")
POINTS = ("start", "forward", "backward", "optimizer", "after-step")


def run(cfg: argparse.Namespace, root: Path, kind: str, point: str) -> dict:
    job = root / uuid.uuid4().hex[:8]
    job.mkdir()
    run_id = f"bench-matrix-{job.name}"
    cmd = [sys.executable, "-m", "ftrun", "--nproc-per-node", str(cfg.nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--rdzv-id", run_id, "--max-restarts", "2", SCRIPT, "--epochs", str(cfg.epochs),
           "--samples", str(cfg.samples), "--batch-size", "8", "--hidden", "64",
           "--fault-dir", str(job), "--pid-log", str(job)]
    if kind:
        cmd += ["--fail-mode", kind, "--fault-at", point, "--kill-at-step",
                str(cfg.fail_at_step), "--kill-rank", str(cfg.fail_rank)]
        if kind == "bitflip":
            cmd += ["--step-sleep", "0.2"]  # the corruption is found before the job ends
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "FTRUN_STATE_DIR": str(job / "state")}
    t0 = time.monotonic()
    with open(job / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(cfg.job_timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_sessions([proc])
    wall = time.monotonic() - t0
    text = (job / "out.log").read_text()
    digests = DIGEST.findall(text)
    cell = {"kind": kind, "point": point, "exit": code, "wall_s": round(wall, 1),
            "digest": digests[-1] if digests else None}
    markers = sorted(job.glob(f"user-ddp-*rank{cfg.fail_rank}-step{cfg.fail_at_step}"))
    cell["fired"] = bool(markers)
    pids: dict[int, list[tuple[int, str, float]]] = {}
    for rank in range(cfg.nproc):
        path = job / f"pids-rank{rank}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        pids[rank] = [(int(s), p, float(t)) for s, p, t in
                      (ln.split() for ln in lines if len(ln.split()) == 3)]
    cell["kept"] = sorted(r for r, ls in pids.items() if len({p for _, p, _ in ls}) == 1)
    if markers:
        fault = float(markers[0].read_text().strip() or markers[0].stat().st_mtime)
        firsts = []
        for ls in pids.values():
            after = [t for _, _, t in ls if t > fault]
            firsts.append(min(after) if after else None)
        if all(f is not None for f in firsts):
            cell["to_next_step_s"] = round(max(firsts) - fault, 2)  # type: ignore[type-var]
    resumed = sorted({int(s) for s in re.findall(r"rank \d resumed from step (\d+)", text)})
    cell["resumed_from"] = resumed
    events = []
    for f in (job / "state").glob("jobs/*/events.jsonl"):
        events += [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    cell["recovery"] = sorted({e.get("how", "?") for e in events if e["type"] == "recovery"})
    cell["named"] = sorted({r for e in events if e["type"] in ("detection", "corruption_detected")
                            for r in e.get("ranks", [])})
    return cell


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--points", default=",".join(POINTS))
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=720, help="30 steps an epoch at 3 ranks")
    p.add_argument("--fail-at-step", type=int, default=20)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--output", metavar="FILE", help="append the report to FILE")
    p.add_argument("--keep", action="store_true")
    cfg = p.parse_args(argv)
    kinds = [k for k in cfg.kinds.split(",") if k]
    points = [q for q in cfg.points.split(",") if q]
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()[0]
    cells = []
    with work_dir("ftrun-bench-matrix-", cfg.keep) as root:
        base = run(cfg, root, "", "")
        for kind in kinds:
            for point in (points if kind != "copy" else ["after-step"]):
                c = run(cfg, root, kind, point)
                c["identical"] = c["digest"] is not None and c["digest"] == base["digest"]
                cells.append(c)
                print(json.dumps(c), file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    import torch

    lines = [
        "## Fault matrix: every kind at every point of a step (issue 27)", "",
        f"- Command: `python bench/fault_matrix.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average (1 min) {load0:.2f} at start / {os.getloadavg()[0]:.2f} at end, Python "
        f"{platform.python_version()}, torch {torch.__version__}; commit {commit}",
        f"- Job: `examples/user_ddp.py --epochs {cfg.epochs} --samples {cfg.samples} "
        f"--batch-size 8 --hidden 64`, 1 launcher x {cfg.nproc} ranks (gloo), default flags "
        f"but `--max-restarts 2`; rank {cfg.fail_rank} fails in step {cfg.fail_at_step}. "
        f"Fault-free: {base['wall_s']} s, params_xxh3 {base['digest']}.", "",
        "| kind | point | fired | fault -> next step | recovery | ranks kept | resumed from "
        "| named | final = fault-free |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        nxt = f"{c['to_next_step_s']:.2f} s" if "to_next_step_s" in c else "—"
        lines.append(f"| {c['kind']} | {c['point']} | {'yes' if c['fired'] else 'NO'} | {nxt} "
                     f"| {', '.join(c['recovery']) or '—'} | {c['kept']} | "
                     f"{c['resumed_from'] or '—'} | {c['named'] or '—'} | "
                     f"{'yes' if c['identical'] else 'NO'} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if cfg.output:
        with open(cfg.output, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    return 0 if all(c["fired"] and c["identical"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
