"""Benchmark: recovery after a worker kill with ftrun's snapshots vs torchrun + torch.save.

For the same job (``examples/train.py``, one node, ``--nproc-per-node 2``, rank 1 SIGKILLs
itself in step ``--fail-at-step``), side by side in one run::

    .venv/bin/python bench/recovery.py [--repeats 2] [--output bench/RESULTS.md]

- ``ftrun``: snapshots every step in memory (train.py ``--snapshot-every 1``);
- ``torchrun + torch.save every K``: what a torchrun user writes (train.py
  ``--torch-save-dir --torch-save-every K``, rank 0 saves, all ranks load at start), with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that its restart resumes at all;
- ``ftrun`` without snapshots (restarts from step 0), for reference.

Reported per launcher: seconds from the kill (the fault marker's timestamp, written just
before the SIGKILL) to the first step completed after the restart, the step it resumed
from, and the steps recomputed (fail step - resumed step; the killed step is counted). Every
faulted run's final ``params_xxh3`` must equal the fault-free run's, or the run is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ftrun.testing import kill_sessions, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
VENV = Path(sys.executable).parent


def run_job(name: str, launcher: list[str], train_args: list[str], work: Path,
            env: dict[str, str], timeout_s: float) -> dict:
    log = work / f"{name}.log"
    steplog = work / f"{name}.steps"
    result = work / f"{name}.json"
    cmd = [*launcher, TRAIN, *train_args, "--step-log", str(steplog), "--result", str(result)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **env}, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_sessions([proc])
            raise SystemExit(f"{name}: no result within {timeout_s:g} s; see {log}") from None
    if code != 0:
        raise SystemExit(f"{name}: exit {code}; see {log}")
    steps = read_jsonl(steplog)
    return {"result": json.loads(result.read_text()), "steps": steps, "log": log}


def measure(name: str, launcher: list[str], train_args: list[str], fail_at: int, work: Path,
            env: dict[str, str], timeout_s: float, clean_hash: str | None) -> dict:
    fault_dir = work / f"{name}-fault"
    args = [*train_args, "--fail-at-step", str(fail_at), "--fail-rank", "1", "--fail-mode",
            "kill", "--fault-dir", str(fault_dir)]
    t0 = time.time()
    job = run_job(name, launcher, args, work, env, timeout_s)
    marker = fault_dir / f"fault-fired-rank1-step{fail_at}"
    killed_at = json.loads(marker.read_text().splitlines()[0])["time"]
    after = [s for s in job["steps"] if s["restart"] >= 1]
    if not after:
        raise SystemExit(f"{name}: no step after the restart; see {job['log']}")
    resumed = (job["result"]["resumed_from"] or [0])[-1]
    if clean_hash is not None and job["result"]["params_xxh3"] != clean_hash:
        raise SystemExit(f"{name}: params_xxh3 {job['result']['params_xxh3']} differs from the "
                         f"fault-free {clean_hash}: determinism broken")
    return {"kill_to_step_s": after[0]["time"] - killed_at, "resumed_from": resumed,
            "recomputed": fail_at - resumed, "wall_s": time.time() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail-at-step", type=int, default=19)
    p.add_argument("--save-every", type=int, default=10, help="K for torch.save (default 10)")
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--output", metavar="FILE")
    args = p.parse_args()
    base = ["--steps", str(args.steps), "--step-sleep", str(args.step_sleep)]
    work = Path(tempfile.mkdtemp(prefix="ftrun-bench-recovery-"))
    state = {"FTRUN_STATE_DIR": str(work / "state")}
    ftrun = [str(VENV / "ftrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    torchrun = [str(VENV / "torchrun"), "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1"]
    torch_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    try:
        clean = run_job("clean", ftrun, [*base, "--snapshot-every", "0"], work, state,
                        args.timeout)["result"]["params_xxh3"]
        cases = {
            "ftrun, snapshot every step": (ftrun, [*base, "--snapshot-every", "1"], state),
            f"torchrun + torch.save every {args.save_every}": (
                torchrun, [*base, "--snapshot-every", "0", "--torch-save-every",
                           str(args.save_every)], torch_env),
            "ftrun, no snapshots (restart from 0)": (ftrun, [*base, "--snapshot-every", "0"],
                                                     state),
        }
        rows = []
        for label, (launcher, targs, env) in cases.items():
            runs = []
            for i in range(args.repeats):
                name = f"{uuid.uuid4().hex[:6]}-{i}"
                extra = (["--torch-save-dir", str(work / f"{name}-ckpt")]
                         if "--torch-save-every" in targs else [])
                runs.append(measure(name, launcher, [*targs, *extra], args.fail_at_step, work,
                                    env, args.timeout, clean))
                print(f"{label}: {runs[-1]}", flush=True)
            rows.append((label, runs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {label: statistics.median(r["kill_to_step_s"] for r in runs) for label, runs in rows}
    ftrun_s = med["ftrun, snapshot every step"]
    lines = [
        "| launcher | kill -> next step (median s) | resumed from | steps recomputed | "
        "vs ftrun |",
        "|---|---|---|---|---|",
    ]
    for label, runs in rows:
        lines.append(
            f"| {label} | {med[label]:.2f} | {runs[0]['resumed_from']} | "
            f"{runs[0]['recomputed']} | {med[label] / ftrun_s:.2f}x |"
        )
    table = "\n".join(lines)
    cmd = " ".join(["python", "bench/recovery.py", *sys.argv[1:]])
    note = (f"Job: examples/train.py, 1 node x 2 ranks, {args.steps} steps, "
            f"--step-sleep {args.step_sleep}, rank 1 SIGKILLed in step {args.fail_at_step}; "
            f"{args.repeats} repeat(s); every faulted run ended with the fault-free "
            f"params_xxh3 {clean}. Time to the next step includes restarting the workers "
            "(python + torch import), the rendezvous and the restore; recomputed steps cost "
            "their full step time on top.")
    print(table)
    print(note)
    if args.output:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.output, "a") as f:
            f.write(f"\n## Recovery: snapshots vs torch.save every K (issue: in-memory "
                    f"snapshots)\n\n`{cmd}` on {date}, 2 cores, CPU only.\n\n{table}\n\n{note}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
