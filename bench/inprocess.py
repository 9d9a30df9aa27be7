"""Benchmark: fault -> next step with in-process restart, ftrun's process restart and torchrun.

One command, every variant side by side, repeats interleaved::

    .venv/bin/python bench/inprocess.py [--repeats 2] [--output bench/RESULTS.md]

The job is ``examples/user_ddp.py`` (``@ftrun.resilient``, ``Snapshotter``; gloo on CPU) on one
launcher x ``--nproc`` ranks, c10d rendezvous, ``--max-restarts 1``. Rank ``--fail-rank`` fails
in step ``--fail-at-step`` (SIGKILL, or raising an exception); the fault marker the script
creates just before is the fault's time. "fault -> next step" ends when every rank has logged
a step after the fault (``--pid-log``: one ``step pid time`` line per step and rank).

Variants:

- ``ftrun in place, kill`` / ``ftrun in place, raise``: in-process restart (the default,
  ``FTRUN_INPLACE_TIMEOUT=5``): the dead rank gets a new process, the others restart in
  place (the event log's ``recovery`` says how);
- ``ftrun in place + warm workers, kill``: the same with ``FTRUN_WARM_WORKERS=1``: the dead
  rank's new process is an interpreter started ahead with torch imported;
- ``ftrun process restart, kill``: ``FTRUN_INPLACE_TIMEOUT=0`` (every rank a new process,
  resumed from the snapshot);
- ``torchrun, kill``: ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (new
  processes; the Snapshotter does nothing under torchrun, so the job starts over at step 1).

Every faulted run's final ``params_xxh3`` must equal the fault-free ftrun run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ftrun.testing import free_port, kill_sessions, work_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "user_ddp.py")
DIGEST = re.compile(r"user-ddp: step=\d+ world=\d+ params_xxh3=([0-9a-f]+)")


@dataclass
class Variant:
    name: str
    launcher: str  # ftrun | torchrun
    fail_mode: str  # kill | raise | "" (fault-free)
    env: dict[str, str]


VARIANTS = [
    Variant("ftrun in place, kill", "ftrun", "kill", {"FTRUN_INPLACE_TIMEOUT": "5"}),
    Variant("ftrun in place, raise", "ftrun", "raise", {"FTRUN_INPLACE_TIMEOUT": "5"}),
    Variant("ftrun in place + warm workers, kill", "ftrun", "kill",
            {"FTRUN_INPLACE_TIMEOUT": "5", "FTRUN_WARM_WORKERS": "1"}),
    Variant("ftrun process restart (FTRUN_INPLACE_TIMEOUT=0), kill", "ftrun", "kill",
            {"FTRUN_INPLACE_TIMEOUT": "0"}),
    Variant("torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, kill", "torchrun", "kill",
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
]


@dataclass
class Result:
    digest: str | None
    to_step_s: float | None
    next_step: int | None
    how: str
    wall_s: float


def run_job(cfg: argparse.Namespace, v: Variant, root: Path) -> Result:
    job = root / uuid.uuid4().hex[:8]
    job.mkdir()
    run_id = f"bench-inproc-{job.name}"
    launcher = ([sys.executable, "-m", "ftrun"] if v.launcher == "ftrun"
                else [str(Path(sys.executable).with_name("torchrun"))])
    cmd = [*launcher, "--nproc-per-node", str(cfg.nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
           "--max-restarts", "1", SCRIPT, "--epochs", str(cfg.epochs), "--samples",
           str(cfg.samples), "--batch-size", "8", "--hidden", "64", "--fault-dir", str(job),
           "--pid-log", str(job)]
    if cfg.device != "cpu":
        cmd += ["--device", cfg.device]
    if v.fail_mode == "stop" and v.launcher == "torchrun":
        # torchrun has no hang detection: the survivors wait out the process group's
        # timeout (torch's default: 30 min), then fail and torchrun restarts everything.
        cmd += ["--pg-timeout", str(cfg.stop_pg_timeout)]
    if v.fail_mode:
        cmd += ["--fail-mode", v.fail_mode, "--kill-at-step", str(cfg.fail_at_step),
                "--kill-rank", str(cfg.fail_rank)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "FTRUN_STATE_DIR": str(job / "state"), **v.env}
    t0 = time.monotonic()
    with open(job / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            proc.wait(cfg.job_timeout)
        except subprocess.TimeoutExpired:
            print(f"  {v.name}: timed out after {cfg.job_timeout} s", file=sys.stderr)
        finally:
            kill_sessions([proc])
    wall = time.monotonic() - t0
    text = (job / "out.log").read_text()
    digests = DIGEST.findall(text)
    to_step, next_step = None, None
    marker = job / f"user-ddp-fault-rank{cfg.fail_rank}-step{cfg.fail_at_step}"
    if marker.exists():
        # The script writes the fault's time into the marker (a file's mtime lags by up to
        # a clock tick, longer than a step on a GPU).
        text_time = marker.read_text().strip()
        fault = float(text_time) if text_time else marker.stat().st_mtime
        firsts = []
        for rank in range(cfg.nproc):
            lines = [ln.split() for ln in (job / f"pids-rank{rank}.log").read_text().splitlines()]
            # The restarted world's first step on this rank: the failing rank's first line
            # after the fault (it fails before logging the step); another rank's first line
            # after it in a new process, or repeating a step (survivors may log the faulty
            # step itself after the marker, then resume from the snapshot before it).
            first, prev = None, None
            for s, pid, t in lines:
                if float(t) > fault and (rank == cfg.fail_rank or prev is not None and (
                        pid != prev[1] or int(s) <= int(prev[0]))):
                    first = (float(t), int(s))
                    break
                prev = (s, pid)
            firsts.append(first)
        if all(firsts):
            to_step = max(f[0] for f in firsts if f) - fault
            next_step = max(f[1] for f in firsts if f)
    how = "—"
    events = job / "state" / "jobs" / run_id / "events.jsonl"
    if events.exists():
        recs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
        hows = [f"{r['how']} (new: {r.get('new_processes', 'all')})" for r in recs
                if r.get("type") == "recovery"]
        how = ", ".join(hows) or "—"
    elif v.launcher == "torchrun" and v.fail_mode:
        how = "new processes (torch)"
    return Result(digests[-1] if digests else None, to_step, next_step, how, wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=384, help="384/3/8: 16 steps per epoch")
    p.add_argument("--fail-at-step", type=int, default=10)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL, one rank per GPU (--nproc at most the GPUs)")
    p.add_argument("--fail-mode", choices=("kill", "raise", "stop"),
                   help="every variant fails this way (default: each variant's own)")
    p.add_argument("--stop", action="store_true",
                   help="add the SIGSTOP case: ftrun in place, ftrun process restart, and "
                        "torchrun with the script's --pg-timeout")
    p.add_argument("--stop-pg-timeout", type=float, default=15.0,
                   help="torchrun's SIGSTOP case: the process group timeout (default 15 s)")
    p.add_argument("--output", metavar="FILE", help="append the report to FILE")
    p.add_argument("--keep", action="store_true")
    cfg = p.parse_args(argv)
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()[0]
    variants = list(VARIANTS)
    if cfg.stop:
        variants += [
            Variant("ftrun in place, stop", "ftrun", "stop", {"FTRUN_INPLACE_TIMEOUT": "5"}),
            Variant("ftrun process restart (FTRUN_INPLACE_TIMEOUT=0), stop", "ftrun", "stop",
                    {"FTRUN_INPLACE_TIMEOUT": "0"}),
            Variant(f"torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, stop (--pg-timeout "
                    f"{cfg.stop_pg_timeout:g})", "torchrun", "stop",
                    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})]
    if cfg.fail_mode:
        named: dict[str, Variant] = {}
        for v in VARIANTS:
            name = v.name.rpartition(", ")[0] + f", {cfg.fail_mode}"
            named.setdefault(name, Variant(name, v.launcher, cfg.fail_mode, v.env))
        variants = list(named.values())
    with work_dir("ftrun-bench-inproc-", cfg.keep) as root:
        base = run_job(cfg, Variant("fault-free", "ftrun", "", {}), root)
        runs: dict[str, list[Result]] = {v.name: [] for v in variants}
        for i in range(cfg.repeats):
            for v in variants:
                r = run_job(cfg, v, root)
                runs[v.name].append(r)
                print(f"[{i + 1}/{cfg.repeats}] {v.name}: fault -> next step "
                      f"{r.to_step_s if r.to_step_s is None else round(r.to_step_s, 2)} s, "
                      f"{r.how}, digest ok: {r.digest == base.digest}", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    import torch

    lines = [
        "## In-process restart: only the dead rank gets a new process (issue 17)", "",
        f"- Command: `python bench/inprocess.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average (1 min) {load0:.2f} at start / {os.getloadavg()[0]:.2f} at end, Python "
        f"{platform.python_version()}, torch {torch.__version__}",
        f"- Code: commit {commit}",
        f"- Job: `examples/user_ddp.py --epochs {cfg.epochs} --samples {cfg.samples} "
        f"--batch-size 8 --hidden 64` ({'NCCL, GPU' if cfg.device == 'cuda' else 'gloo, CPU'}), "
        f"1 launcher x {cfg.nproc} ranks, c10d "
        f"rendezvous, `--max-restarts 1`; rank {cfg.fail_rank} fails in step "
        f"{cfg.fail_at_step}; {cfg.repeats} repeat(s), variants interleaved. \"fault -> next "
        "step\": from the fault marker (written just before the kill or raise) until every "
        "rank logged a step after it. Fault-free run: "
        f"{base.wall_s:.1f} s, params_xxh3 {base.digest}.", "",
        "| variant | fault -> next step, median (min-max) | next step | recovery | "
        "final params = fault-free | job wall time, median |",
        "|---|---|---|---|---|---|",
    ]
    for v in variants:
        rs = runs[v.name]
        ts = [r.to_step_s for r in rs if r.to_step_s is not None]
        cell = (f"{statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f})" if ts
                else "no step after the fault")
        nexts = sorted({r.next_step for r in rs if r.next_step is not None})
        ok = sum(r.digest == base.digest for r in rs)
        lines.append(f"| {v.name} | {cell} | {', '.join(map(str, nexts)) or '—'} | "
                     f"{'; '.join(sorted({r.how for r in rs}))} | {ok}/{len(rs)} | "
                     f"{statistics.median(r.wall_s for r in rs):.1f} s |")
    lines.append("")

    def med(v: Variant) -> float | None:
        ts = [r.to_step_s for r in runs[v.name] if r.to_step_s is not None]
        return statistics.median(ts) if ts else None

    for v in variants:
        if v.launcher != "ftrun" or "in place" not in v.name or med(v) is None:
            continue
        torchrun = next((med(t) for t in variants if t.launcher == "torchrun"
                         and t.fail_mode == v.fail_mode), None)
        restart = next((med(t) for t in variants if t.launcher == "ftrun"
                        and t.fail_mode == v.fail_mode and "in place" not in t.name), None)
        if torchrun:
            extra = f", {med(v) / restart:.3f}x ftrun's process restart" if restart else ""
            lines.append(f"- {v.name}: fault -> next step / torchrun's = {med(v):.2f} / "
                         f"{torchrun:.2f} s = **{med(v) / torchrun:.3f}x**{extra}.")
    report = "\n".join(lines) + "\n"
    print(report)
    if cfg.output:
        with open(cfg.output, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
