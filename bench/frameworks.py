"""Benchmark: ftrun snapshots in Lightning, the HF Trainer and Accelerate, against each
framework's own on-disk checkpoint. One command, every framework side by side::

    .venv/bin/python bench/frameworks.py [--output bench/RESULTS.md]

For each framework its example (``examples/lightning_ddp.py``, ``examples/hf_trainer.py``,
``examples/accelerate_ddp.py``, with a larger model than their defaults) runs on one node of
``--nproc`` ranks (gloo, CPU), through ``bench/_framework_worker.py``, which times every
optimizer step, every ``Snapshotter.save``/``wait`` call and every call of the framework's
own save. Runs, all over the same ``--steps`` steps:

- ``ftrun, snapshots auto``: ``ftrun --snapshot-every auto``;
- ``ftrun, snapshots off``: ``--snapshot-every`` longer than the run (the launcher has no
  off switch: 0 is refused), so no step is snapshotted until ``close()`` takes the last one,
  after the measured steps;
- ``torchrun``: the same script under plain ``torchrun`` (ftrun's callback and Snapshotter
  say once that snapshots are off);
- ``ftrun off + <framework checkpoint>``: snapshots off as above, and the framework's own
  checkpoint every ``--ckpt-every`` steps (Lightning ``ModelCheckpoint(every_n_train_steps)``
  through ``trainer.save_checkpoint``; the HF Trainer's ``save_steps``, ``_save_checkpoint``;
  ``accelerator.save_state``), written into the run's directory on disk.

Throughput is steps/s over the steps after ``--warmup`` (start-up, the first save's buffer
allocation and, under ``auto``, the warm-up interval until the ranks first agree on one at
step 32 are left out), per rank, median over ranks. ftrun's blocking time is the time the
training thread spends inside ``Snapshotter.save`` and ``wait`` (the optimizer pre-hook that
holds the next step until the background copy is done) in those steps; the framework's is
the duration of its save call, and, as a check, how much longer the steps that saved took
than the others (medians).

``--recovery`` measures recovery instead: each example (its default, small model) on one
node of ``--nproc`` ranks, rank 1 SIGKILLed after its optimizer step ``Framework.fault_step``
(mid-epoch, in the second epoch), ``--repeats`` times, variants interleaved:

- ``ftrun in place``: the example with ``--resilient`` (its training function under
  ``@ftrun.resilient``): the killed rank gets a new process, the others run the function
  again in theirs;
- ``ftrun new processes``: the example as it was (no decorator): every rank a new process,
  resumed from the snapshot;
- ``torchrun``: ``torchrun --max-restarts 1``: every rank a new process; snapshots are off
  under torchrun, so training starts over at step 1.

"fault → next step": from the fault marker's time (written just before the kill) until every
rank has logged a step after it (``--pid-log``: ``step pid time`` per step and rank). Every
run's final weights are compared with a fault-free ftrun run's.

``--snapshot-parts`` measures where a Lightning snapshot's time goes on the training thread,
in one process (one rank, no launcher, nothing else of the job running): the example's model
(``--lightning-hidden``) trained a few steps by a Trainer, then each part of what the callback
and the Snapshotter do for a snapshot, and what they do every step, timed alone in CPU time of
the process (``time.process_time``: what other processes on the machine take does not count),
the best of 5 rounds of ``--repeats``×40 calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from ftrun.testing import (
    free_port,
    freeze_code,
    git_tree,
    kill_sessions,
    read_events,
    work_dir,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "_framework_worker.py")
OFF_EVERY = "1000000"


@dataclass(frozen=True)
class Framework:
    name: str  # the worker's argument
    label: str
    package: str  # whose version the report gives
    save_api: str  # the framework's own checkpoint, as the report names it
    job: Callable[[argparse.Namespace, Path], list[str]]  # the example's flags
    ckpt_flag: str  # the example's flag that adds that checkpoint every N steps
    ckpt_glob: str  # one checkpoint, under the directory the example writes them to
    recovery: Callable[[Path], list[str]]  # the example's flags for --recovery
    fault_step: int  # --recovery: rank 1 is killed after this optimizer step
    marker: str  # --recovery: the example's fault marker (its name's prefix)



def _emit(lines: list[str], output: str | None) -> None:
    """Print a report, and append it to ``output`` when one is given."""
    print("\n".join(lines))
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines))

def lightning_job(cfg: argparse.Namespace, job: Path) -> list[str]:
    # One epoch longer than twice the run: the validation at half an epoch (and the default
    # ModelCheckpoint's save after it) come after the last measured step.
    steps_per_epoch = 2 * cfg.steps + 8
    samples = math.ceil(steps_per_epoch * 8 * cfg.nproc * 4 / 3)
    return ["--hidden", str(cfg.lightning_hidden), "--batch-size", "8", "--samples",
            str(samples), "--epochs", "1", "--max-steps", str(cfg.steps), "--root-dir",
            str(job / "ckpt")]


def hf_job(cfg: argparse.Namespace, job: Path) -> list[str]:
    return ["--n-embd", str(cfg.hf_embd), "--n-layer", str(cfg.hf_layers), "--batch-size", "4",
            "--samples", str(cfg.steps * 4 * cfg.nproc), "--max-steps", str(cfg.steps),
            "--output-dir", str(job / "ckpt")]


def accelerate_job(cfg: argparse.Namespace, job: Path) -> list[str]:
    return ["--hidden", str(cfg.accelerate_hidden), "--batch-size", "8", "--samples",
            str(cfg.steps * 8 * cfg.nproc), "--epochs", "1", "--save-dir", str(job / "ckpt")]


# --recovery, at 3 ranks: Lightning 6 steps an epoch (12 in all), the Trainer 4 (10 in all),
# Accelerate 4 (8 in all); the fault in the second epoch, a few steps before the end.
FRAMEWORKS = {f.name: f for f in (
    Framework("lightning", "PyTorch Lightning", "lightning",
              "`ModelCheckpoint(every_n_train_steps=N)` → `trainer.save_checkpoint`",
              lightning_job, "--ckpt-every", "**/*.ckpt",
              lambda job: ["--samples", "192", "--epochs", "2", "--root-dir", str(job / "ckpt")],
              9, "lightning-fault"),
    Framework("hf", "Hugging Face Trainer", "transformers",
              "`save_steps=N` → `Trainer._save_checkpoint`",
              hf_job, "--save-steps", "checkpoint-*",
              lambda job: ["--samples", "48", "--max-steps", "10", "--output-dir",
                           str(job / "ckpt")],
              6, "hf-trainer-fault"),
    Framework("accelerate", "Accelerate", "accelerate",
              "`accelerator.save_state(dir)` every N steps",
              accelerate_job, "--save-state-every", ".",
              lambda job: ["--samples", "96", "--epochs", "2", "--save-dir", str(job / "ckpt")],
              6, "accelerate-ddp-fault"),
)}


RUNS = ("off", "auto", "torchrun", "ckpt")  # --runs


@dataclass
class Variant:
    key: str  # one of RUNS
    name: str
    launcher: str  # ftrun | torchrun
    every: str = OFF_EVERY
    ckpt: bool = False


@dataclass
class Run:
    variant: Variant
    ok: bool
    wall_s: float
    log: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    ckpt_bytes: int = 0
    load: float = 0.0  # the 1-minute load average when the run ended (others' jobs show here)


def run_logged(cfg: argparse.Namespace, cmd: list[str], job: Path, label: str,
               **env: str) -> tuple[int | None, float]:
    """Run ``cmd`` in ``job`` (output to ``job/out.log``, the job's state under
    ``job/state``), at most ``--job-timeout`` seconds; its processes are all gone after.
    Returns (exit code, None on a timeout; wall time in seconds)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "FTRUN_STATE_DIR": str(job / "state"),
                **env}
    full_env.pop("FTRUN_STORE", None)
    t0 = time.monotonic()
    with open(job / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                cwd=job, start_new_session=True)
        try:
            code: int | None = proc.wait(cfg.job_timeout)
        except subprocess.TimeoutExpired:
            code = None
            print(f"  {label}: timed out after {cfg.job_timeout} s", file=sys.stderr)
        finally:
            kill_sessions([proc])
    return code, time.monotonic() - t0


def run_job(cfg: argparse.Namespace, fw: Framework, v: Variant, root: Path,
            shm_dir: Path) -> Run:
    job = root / f"{fw.name}-{uuid.uuid4().hex[:8]}"
    timings = job / "timings"
    timings.mkdir(parents=True)
    if v.launcher == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--snapshot-every", v.every]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun"))]
    cmd += ["--standalone", "--nproc-per-node", str(cfg.nproc), "--rdzv-id",
            f"bench-fw-{job.name}", WORKER, fw.name, *fw.job(cfg, job)]
    if v.ckpt:
        cmd += [fw.ckpt_flag, str(cfg.ckpt_every)]
    code, wall = run_logged(cfg, cmd, job, f"{fw.name} / {v.name}",
                            FTRUN_SHM_DIR=str(shm_dir), FTRUN_BENCH_TIMINGS=str(timings))
    ranks = [json.loads(p.read_text()) for p in sorted(timings.glob("rank*.json"))]
    run = Run(v, code == 0 and len(ranks) == cfg.nproc, wall, str(job / "out.log"), ranks,
              load=os.getloadavg()[0])
    if not run.ok:
        tail = (job / "out.log").read_text()[-3000:]
        print(f"  {fw.name} / {v.name}: exit {code}, {len(ranks)} timing file(s)\n{tail}",
              file=sys.stderr)
    if v.ckpt:
        ckpts = [job / "ckpt"] if fw.ckpt_glob == "." else (job / "ckpt").glob(fw.ckpt_glob)
        run.ckpt_bytes = max((dir_bytes(p) for p in ckpts), default=0)
    if not cfg.keep:
        shutil.rmtree(job / "ckpt", ignore_errors=True)
    return run


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- recovery (--recovery) ------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryVariant:
    name: str
    launcher: str  # ftrun | torchrun
    resilient: bool = False  # the example's --resilient: its function under @ftrun.resilient


RECOVERY_VARIANTS = (
    RecoveryVariant("ftrun in place (@ftrun.resilient)", "ftrun", resilient=True),
    RecoveryVariant("ftrun new processes (no decorator)", "ftrun"),
    RecoveryVariant("torchrun --max-restarts 1", "torchrun"),
)
DIGEST = re.compile(r"(?:lightning-ddp|hf-trainer|accelerate-ddp): step=\d+ world=\d+ "
                    r"params_xxh3=([0-9a-f]+)")
FAULT_RANK = 1


@dataclass
class Recovery:
    ok: bool
    wall_s: float
    digest: str | None
    to_step_s: float | None  # fault -> every rank logged a step after it
    next_step: int | None  # the highest of those first steps
    how: str  # the recovery events, or torchrun's
    kept: list[int]  # ranks whose every step ran in one process
    log: str


def run_recovery(cfg: argparse.Namespace, fw: Framework, v: RecoveryVariant, root: Path,
                 code: Path, fault: bool) -> Recovery:
    """One job of ``code`` (a frozen copy of ftrun and the examples)."""
    job = root / f"{fw.name}-recovery-{uuid.uuid4().hex[:8]}"
    job.mkdir(parents=True)
    run_id = f"bench-fw-rec-{job.name}"
    launcher = ([sys.executable, "-m", "ftrun"] if v.launcher == "ftrun"
                else [str(Path(sys.executable).with_name("torchrun"))])
    cmd = [*launcher, "--nproc-per-node", str(cfg.nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
           "--max-restarts", "1", str(code / SCRIPT_OF[fw.name]), *fw.recovery(job),
           "--fault-dir", str(job), "--pid-log", str(job)]
    if v.resilient:
        cmd.append("--resilient")
    if fault:
        cmd += ["--kill-at-step", str(fw.fault_step), "--kill-rank", str(FAULT_RANK)]
    exit_code, wall = run_logged(cfg, cmd, job, f"{fw.name} / {v.name}",
                                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                 PYTHONPATH=os.pathsep.join(
                                     filter(None, [str(code), os.environ.get("PYTHONPATH")])))
    digests = DIGEST.findall((job / "out.log").read_text())
    steps: dict[int, list[tuple[int, str, float]]] = {}
    for rank in range(cfg.nproc):
        path = job / f"pids-rank{rank}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        steps[rank] = [(int(st), pid, float(t)) for st, pid, t in (ln.split() for ln in lines)]
    kept = sorted(r for r, ls in steps.items() if len({pid for _, pid, _ in ls}) == 1)
    to_step, next_step = None, None
    marker = job / f"{fw.marker}-rank{FAULT_RANK}-step{fw.fault_step}"
    if fault and marker.exists():
        at = float(marker.read_text().strip())
        # Each rank's first step logged after the fault; the failed rank's is its new
        # process's first, and the survivors' next collective waits for it.
        firsts = [min(((t, st) for st, _, t in ls if t > at), default=None)
                  for ls in steps.values()]
        if all(f is not None for f in firsts):
            last_t, next_step = max(f for f in firsts if f)
            to_step = last_t - at
    events = read_events(job / "state", run_id) if v.launcher == "ftrun" else []
    hows = [f"{e['how']} (new: {e.get('new_processes', 'all')})" for e in events
            if e["type"] == "recovery"]
    how = ", ".join(hows) or ("new processes (torch)" if v.launcher == "torchrun" else "—")
    ok = exit_code == 0 and len(digests) == 1 and (not fault or to_step is not None)
    if not ok:
        print(f"  {fw.name} / {v.name}: exit {exit_code}\n{(job / 'out.log').read_text()[-3000:]}",
              file=sys.stderr)
    return Recovery(ok, wall, digests[-1] if digests else None, to_step, next_step, how, kept,
                    str(job / "out.log"))


def recovery_report(cfg: argparse.Namespace, fw: Framework, base: Recovery,
                    runs: dict[str, list[Recovery]]) -> list[str]:
    args = " ".join(fw.recovery(Path("DIR")))
    lines = [f"### {fw.label} ({fw.package} {version(fw.package)})", "",
             f"Job: `{SCRIPT_OF[fw.name]} {args}` on 1 node × {cfg.nproc} ranks (gloo, CPU), "
             f"rank {FAULT_RANK} SIGKILLed after its optimizer step {fw.fault_step}; fault-free "
             f"run {base.wall_s:.1f} s, params_xxh3 {base.digest}.", "",
             "| variant | fault → next step, median (min–max) | next step | recovery | ranks "
             "that kept their process | final params = fault-free | job wall time, median |",
             "|---|---|---|---|---|---|---|"]
    medians: dict[str, float] = {}
    for v in RECOVERY_VARIANTS:
        rs = runs[v.name]
        times = [r.to_step_s for r in rs if r.to_step_s is not None]
        if times:
            medians[v.name] = statistics.median(times)
        cell = (f"{medians[v.name]:.2f} s ({min(times):.2f}–{max(times):.2f})" if times
                else "failed")
        same = sum(r.ok and r.digest == base.digest for r in rs)
        lines.append(
            f"| {v.name} | {cell} | {', '.join(sorted({str(r.next_step) for r in rs}))} | "
            f"{'; '.join(sorted({r.how for r in rs}))} | "
            f"{'; '.join(sorted({str(r.kept) for r in rs}))} | {same}/{len(rs)} | "
            f"{statistics.median(r.wall_s for r in rs):.1f} s |")
    lines.append("")
    inplace, restart, torchrun = (medians.get(v.name) for v in RECOVERY_VARIANTS)
    if inplace is not None and torchrun:
        lines.append(f"- In place / torchrun: {inplace:.2f} / {torchrun:.2f} s = "
                     f"**{inplace / torchrun:.2f}×**"
                     + (f"; / ftrun's new processes: {inplace / restart:.2f}×." if restart
                        else "."))
    return lines + [""]


def main_recovery(cfg: argparse.Namespace, names: list[str], argv: list[str] | None) -> int:
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()
    reports: list[str] = []
    failed = 0
    with work_dir("ftrun-bench-fw-recovery-", cfg.keep) as root:
        # Jobs import a copy of the committed code taken now: others edit the tree meanwhile.
        code = root / "code"
        digest = freeze_code(code, ("ftrun", "examples"), cfg.commit)
        for name in names:
            fw = FRAMEWORKS[name]
            base = run_recovery(cfg, fw, RECOVERY_VARIANTS[1], root, code, fault=False)
            failed += not base.ok
            runs: dict[str, list[Recovery]] = {v.name: [] for v in RECOVERY_VARIANTS}
            for i in range(cfg.repeats):
                for v in RECOVERY_VARIANTS:
                    r = run_recovery(cfg, fw, v, root, code, fault=True)
                    runs[v.name].append(r)
                    failed += not r.ok or r.digest != base.digest
                    took = f"{r.to_step_s:.2f} s" if r.to_step_s is not None else "FAILED"
                    print(f"{fw.name} / {v.name} #{i + 1}: fault -> next step {took}, "
                          f"{r.how}, kept {r.kept}, same params {r.digest == base.digest}",
                          file=sys.stderr)
            reports += recovery_report(cfg, fw, base, runs)
    import torch

    command = " ".join(["python bench/frameworks.py", *(argv if argv is not None
                                                         else sys.argv[1:])])
    lines = [
        "## Framework integrations: fault → next step in place, side by side with torchrun "
        "(issue 27, item 6)", "",
        f"- Command: `{command}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, no GPU, load "
        f"average (1 min) {load0[0]:.2f} at start / {os.getloadavg()[0]:.2f} at end; Python "
        f"{platform.python_version()}, torch {torch.__version__}",
        f"- Code: commit {git_tree(cfg.commit)}, run from a copy taken at start (sha256 "
        f"{digest})",
        f"- Method: {cfg.repeats} repeat(s) per variant, variants interleaved; c10d "
        "rendezvous, `--max-restarts 1`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` for both "
        "launchers. \"fault → next step\": from the fault marker (written just before the "
        "SIGKILL) until every rank logged a step after it (`--pid-log`); \"next step\": the "
        "highest of those steps (torchrun starts over at step 1).",
        "",
        *reports,
    ]
    _emit(lines, cfg.output)
    return 1 if failed else 0


# -- figures --------------------------------------------------------------------------------------


@dataclass
class Figures:
    steps_per_s: float
    step_s: float  # median step interval in the window
    snap_block_per_step_s: float
    snap_block_per_snapshot_s: float | None
    snapshots: int  # started in the window, per rank (the most of any rank)
    parts_per_snapshot_s: dict[str, float]  # of the blocking, by PARTS
    every: str  # the interval(s) in force in the window
    skipped: int  # of those, given up (the store had not released a buffer in time)
    ckpt_call_s: float | None  # median duration of the framework's save call, max over ranks
    ckpt_call_rank0_s: float | None
    ckpt_step_excess_s: float | None  # median(steps with a save) - median(steps without)
    ckpt_saves: int
    params: int


# Parts of ftrun's blocking time the worker times inside save()/wait(): waiting for the copy
# in flight, capturing the state dicts, creating or growing the shared-memory buffers.
PARTS = ("copy-wait", "capture", "buffers")


def window(rank: dict[str, Any], warmup: int) -> tuple[float, float, list[float]]:
    steps = rank["steps"]
    if len(steps) <= warmup + 1:
        raise ValueError(f"rank {rank['rank']} logged {len(steps)} steps, not more than "
                         f"--warmup {warmup} + 1: run more --steps")
    return steps[warmup - 1] if warmup else steps[0], steps[-1], steps


def figures(run: Run, warmup: int) -> Figures:
    rates, medians, per_step, per_snap, counts, skipped = [], [], [], [], [], []
    ckpt_calls, ckpt_rank0, excess, everies = [], [], [], set()
    parts: dict[str, list[float]] = {}
    saves = 0
    for rank in run.ranks:
        start, end, steps = window(rank, warmup)
        first = warmup if warmup else 1
        n = len(steps) - first
        rates.append(n / (end - start))
        intervals = [b - a for a, b in zip(steps[first - 1:], steps[first:], strict=False)]
        medians.append(statistics.median(intervals))
        inside = [c for c in rank["snap"] if start < c[1] <= end]
        calls = [c for c in inside if c[0] in ("save", "wait")]
        blocked = sum(c[2] - c[1] for c in calls)
        for kind in PARTS:
            parts.setdefault(kind, []).append(sum(c[2] - c[1] for c in inside if c[0] == kind))
        taken = sum(1 for c in calls if c[0] == "save" and c[3])
        everies.update(str(c[4]) for c in calls if c[0] == "save")
        before = [c[5] for c in rank["snap"] if c[1] <= start]
        skipped.append((calls[-1][5] if calls else 0) - (before[-1] if before else 0))
        per_step.append(blocked / n)
        if taken:
            per_snap.append(blocked / taken)
        counts.append(taken)
        ckpts = [c for c in rank["ckpt"] if start < c[0] <= end]
        if ckpts:
            durations = [c[1] - c[0] for c in ckpts]
            ckpt_calls.append(statistics.median(durations))
            if rank["rank"] == 0:
                ckpt_rank0.append(statistics.median(durations))
            saves = max(saves, len(ckpts))
            # A step's interval runs from the previous optimizer step's end to its own: the
            # save after optimizer step k falls into the interval that ends at step k + 1.
            with_save = [i for i, (a, b) in enumerate(zip(steps[first - 1:], steps[first:],
                                                          strict=False))
                         if any(a < c[0] <= b for c in ckpts)]
            plain = [d for i, d in enumerate(intervals) if i not in with_save]
            if with_save and plain:
                excess.append(statistics.median(intervals[i] for i in with_save)
                              - statistics.median(plain))
    return Figures(
        steps_per_s=statistics.median(rates), step_s=statistics.median(medians),
        snap_block_per_step_s=statistics.mean(per_step),
        snap_block_per_snapshot_s=statistics.mean(per_snap) if per_snap else None,
        snapshots=max(counts, default=0),
        parts_per_snapshot_s=({k: statistics.mean(v) / max(counts) for k, v in parts.items()}
                              if max(counts, default=0) else {}),
        every=", ".join(sorted(everies, key=int)) if everies else "—",
        skipped=max(skipped, default=0),
        ckpt_call_s=max(ckpt_calls) if ckpt_calls else None,
        ckpt_call_rank0_s=ckpt_rank0[0] if ckpt_rank0 else None,
        ckpt_step_excess_s=statistics.mean(excess) if excess else None,
        ckpt_saves=saves, params=max(r["params"] for r in run.ranks))


def ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f} ms"


def parts_cell(f: Figures) -> str:
    if not f.parts_per_snapshot_s:
        return ""
    return " (" + ", ".join(ms(f.parts_per_snapshot_s.get(k)) for k in PARTS) + ")"


# -- report ---------------------------------------------------------------------------------------


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def framework_report(cfg: argparse.Namespace, fw: Framework, runs: list[Run],
                     job_args: str) -> list[str]:
    lines = [f"### {fw.label} ({fw.package} {version(fw.package)})", "",
             f"Job: `{SCRIPT_OF[fw.name]} {job_args}` on 1 node × {cfg.nproc} ranks "
             f"(gloo, CPU). Framework checkpoint: {fw.save_api}, N = {cfg.ckpt_every}.", ""]
    figs = {r.variant.name: figures(r, cfg.warmup) for r in runs if r.ok}
    failed = [r.variant.name for r in runs if not r.ok]
    if figs:
        params = max(f.params for f in figs.values())
        state_mb = params * 4 * 3 / 1e6  # fp32 weights + AdamW's exp_avg and exp_avg_sq
        lines += [f"Model: {params / 1e6:.2f} M parameters ({params * 4 / 1e6:.0f} MB fp32; "
                  f"with AdamW's two moments {state_mb:.0f} MB of state per rank).", ""]
    lines += ["| run | steps/s | median step | snapshot interval (steps) | snapshots taken "
              "(skipped) | ftrun blocking per step | ftrun blocking per snapshot (of which: waiting for the copy, capturing the state, "
              "allocating buffers) | framework "
              "save call, median (rank 0) | step with a save − step without | job wall time (load "
              "average at its end) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r.ok:
            lines.append(f"| {r.variant.name} | failed (its log's tail went to stderr) | | | | | | | | "
                         f"{r.wall_s:.1f} s |")
            continue
        f = figs[r.variant.name]
        snap = r.variant.launcher == "ftrun" and r.variant.every != OFF_EVERY
        ckpt = (f"{ms(f.ckpt_call_s)} ({ms(f.ckpt_call_rank0_s)}), {f.ckpt_saves} saves"
                if r.variant.ckpt else "—")
        lines.append(
            f"| {r.variant.name} | {f.steps_per_s:.2f} | {ms(f.step_s)} | "
            f"{f.every if snap else 'off'} | {f'{f.snapshots} ({f.skipped})' if snap else '—'} | "
            f"{ms(f.snap_block_per_step_s) if snap else '—'} | "
            f"{ms(f.snap_block_per_snapshot_s) if snap else '—'}"
            f"{parts_cell(f) if snap else ''}"
            f" | {ckpt} | "
            f"{ms(f.ckpt_step_excess_s) if r.variant.ckpt else '—'} | {r.wall_s:.1f} s "
            f"({r.load:.1f}) |")
    lines.append("")
    by_key = {r.variant.key: figs[r.variant.name] for r in runs if r.ok}
    off, auto, torchrun, ckpt = (by_key.get(k) for k in RUNS)
    ckpt_run = next((r for r in runs if r.variant.ckpt and r.ok), None)
    if auto and off:
        lines.append(f"- Throughput with ftrun snapshots (auto) / without: "
                     f"{auto.steps_per_s:.2f} / {off.steps_per_s:.2f} = "
                     f"**{auto.steps_per_s / off.steps_per_s:.3f}**.")
    if off and torchrun:
        lines.append(f"- ftrun without snapshots / plain torchrun: {off.steps_per_s:.2f} / "
                     f"{torchrun.steps_per_s:.2f} = {off.steps_per_s / torchrun.steps_per_s:.3f}"
                     + (f"; with snapshots (auto) / torchrun: "
                        f"{auto.steps_per_s / torchrun.steps_per_s:.3f}." if auto else "."))
    if ckpt and off:
        lines.append(f"- Throughput with the framework checkpoint every {cfg.ckpt_every} steps "
                     f"/ without: {ckpt.steps_per_s:.2f} / {off.steps_per_s:.2f} = "
                     f"{ckpt.steps_per_s / off.steps_per_s:.3f}.")
    if ckpt and auto and ckpt.ckpt_call_s:
        size = (f" ({ckpt_run.ckpt_bytes / 1e6:.0f} MB on disk per checkpoint)"
                if ckpt_run and ckpt_run.ckpt_bytes else "")
        per_snap = (f"; per snapshot taken {ms(auto.snap_block_per_snapshot_s)}: "
                    f"{ckpt.ckpt_call_s / auto.snap_block_per_snapshot_s:.1f}x"
                    if auto.snap_block_per_snapshot_s else "")
        lines.append(
            f"- Framework checkpoint blocking per save{size}: {ms(ckpt.ckpt_call_s)}, vs ftrun "
            f"snapshot blocking per step {ms(auto.snap_block_per_step_s)}: "
            f"**{ckpt.ckpt_call_s / max(auto.snap_block_per_step_s, 1e-9):.0f}x**{per_snap}.")
    if failed:
        lines.append(f"- Failed: {', '.join(failed)}.")
    return lines + [""]


SCRIPT_OF = {"lightning": "examples/lightning_ddp.py", "hf": "examples/hf_trainer.py",
             "accelerate": "examples/accelerate_ddp.py"}


def snapshot_parts(cfg: argparse.Namespace) -> dict[str, float]:
    """Seconds of CPU per call of each part of a Lightning snapshot and of the per-step path
    (see the module docstring); runs in this process."""
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning.pytorch as pl
    import torch
    from lightning_ddp import Blobs, Classifier
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ftrun.integrations import _lightning
    from ftrun.rank.cadence import Cadence
    from ftrun.rank.progress import create_progress_file, progress
    from ftrun.rank.rng import rng_state
    from ftrun.snapshot.manifest import flatten, manifest_blob

    out: dict[str, float] = {}

    def blob(state: Any) -> bytes:
        return manifest_blob(flatten(state), step=1, rank=0, world_size=1, meta={})

    def best(fn: Callable[[], Any]) -> float:
        fn()
        n = 40 * cfg.repeats
        rounds = []
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(n):
                fn()
            rounds.append((time.process_time() - t0) / n)
        return min(rounds)

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step != 8:
                return
            model, opt = trainer.strategy.model, trainer.optimizers[0]
            dumped = {"lightning": _lightning.dump(trainer, False)}
            dcp = {"model": get_model_state_dict(model),
                   "optim": get_optimizer_state_dict(model, opt)}
            cadence = Cadence(OFF_EVERY)
            parts = {
                "snapshot: Lightning's state (the callback's dump())":
                    lambda: _lightning.dump(trainer, False),
                "  of which: the model's state_dict, thrown away":
                    trainer._checkpoint_connector._get_lightning_module_state_dict,
                "  of which: the optimizer's state_dict, thrown away":
                    lambda: trainer.strategy.optimizer_state(opt),
                "snapshot: Lightning's state, flattened into the manifest":
                    lambda: blob(dumped),
                "snapshot: model and optimizer state dicts (DCP)":
                    lambda: (get_model_state_dict(model), get_optimizer_state_dict(model, opt)),
                "snapshot: model and optimizer, flattened into the manifest":
                    lambda: blob(dcp),
                "snapshot: RNG states": rng_state,
                "every step: trainer.global_step": lambda: trainer.global_step,
                "every step: ftrun.progress()": lambda: progress(8),
                "every step: the cadence (observe, due, mark)":
                    lambda: (cadence.observe(0.004), cadence.mark(cadence.due(8))),
            }
            for name, fn in parts.items():
                out[name] = best(fn)

    work = Path(tempfile.mkdtemp(prefix="ftrun-bench-parts-"))
    try:
        create_progress_file(str(work / "progress"))
        os.environ["FTRUN_PROGRESS_FILE"] = str(work / "progress")
        torch.manual_seed(0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[Probe()],
                             default_root_dir=str(work))
        trainer.fit(Classifier(hidden=cfg.lightning_hidden), datamodule=Blobs(samples=2000))
    finally:
        os.environ.pop("FTRUN_PROGRESS_FILE", None)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main_parts(cfg: argparse.Namespace, argv: list[str] | None) -> int:
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()
    parts = snapshot_parts(cfg)
    import torch

    command = " ".join(["python bench/frameworks.py", *(argv if argv is not None
                                                         else sys.argv[1:])])
    rows = [f"| {name} | {1e6 * s:.0f} µs |" for name, s in parts.items()]
    snapshot = sum(s for name, s in parts.items() if name.startswith("snapshot:"))
    lightning = sum(s for name, s in parts.items() if name.startswith("snapshot: Lightning"))
    step = sum(s for name, s in parts.items() if name.startswith("every step:"))
    lines = [
        "## Where a Lightning snapshot's time goes, part by part (CPU time, one process)", "",
        f"- Command: `{command}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"(1 min) {load0[0]:.2f} at start / {os.getloadavg()[0]:.2f} at end; Python "
        f"{platform.python_version()}, torch {torch.__version__}, lightning "
        f"{version('lightning')}",
        f"- Code: commit {git_tree()}",
        f"- Model: `examples/lightning_ddp.py`'s, `--hidden {cfg.lightning_hidden}`, one rank; "
        f"each part the best of 5 rounds of {40 * cfg.repeats} calls, CPU time of the process.",
        "", "| part | CPU per call |", "|---|---|", *rows, "",
        f"- A snapshot's parts together: {1e6 * snapshot:.0f} µs, of which Lightning's state "
        f"{1e6 * lightning:.0f} µs ({100 * lightning / snapshot:.0f}%); every step: "
        f"{1e6 * step:.0f} µs.",
    ]
    _emit(lines, cfg.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="lightning,hf,accelerate",
                   help="comma-separated, from: " + ", ".join(FRAMEWORKS))
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--warmup", type=int, default=32,
                   help="steps left out of the measurement (auto's first agreement: step 32)")
    p.add_argument("--ckpt-every", type=int, default=8,
                   help="the framework checkpoint's interval, in steps")
    p.add_argument("--lightning-hidden", type=int, default=3072)
    p.add_argument("--hf-embd", type=int, default=384)
    p.add_argument("--hf-layers", type=int, default=6)
    p.add_argument("--accelerate-hidden", type=int, default=3072)
    p.add_argument("--no-torchrun", action="store_true", help="leave the torchrun run out")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="which runs, comma-separated, from: " + ", ".join(RUNS))
    p.add_argument("--quick", action="store_true",
                   help="a check of the whole path: tiny models, 24 steps (figures say little)")
    p.add_argument("--recovery", action="store_true",
                   help="measure fault -> next step (in place, new processes, torchrun) "
                        "instead of the snapshot overhead")
    p.add_argument("--snapshot-parts", action="store_true",
                   help="measure the CPU time of each part of a Lightning snapshot and of the "
                        "callback's per-step path, in this process, instead of whole jobs")
    p.add_argument("--repeats", type=int, default=3,
                   help="--recovery: runs per variant; --snapshot-parts: 40×N calls a round")
    p.add_argument("--commit", default="HEAD",
                   help="--recovery: the commit whose ftrun and examples the jobs run")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--output", metavar="FILE", help="append the report to FILE")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    cfg = p.parse_args(argv)
    if cfg.quick:
        cfg.steps, cfg.warmup, cfg.ckpt_every = 24, 8, 4
        cfg.lightning_hidden, cfg.hf_embd, cfg.hf_layers, cfg.accelerate_hidden = 128, 64, 2, 128
    names = [n.strip() for n in cfg.frameworks.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        p.error(f"--frameworks: unknown {unknown or names}; choose from {', '.join(FRAMEWORKS)}")
    if cfg.snapshot_parts:
        if cfg.repeats < 1:
            p.error(f"--repeats {cfg.repeats}: at least 1")
        return main_parts(cfg, argv)
    if cfg.recovery:
        if cfg.repeats < 1:
            p.error(f"--repeats {cfg.repeats}: at least 1")
        return main_recovery(cfg, names, argv)
    if cfg.steps <= cfg.warmup + cfg.ckpt_every:
        p.error(f"--steps {cfg.steps} leaves fewer than --ckpt-every {cfg.ckpt_every} steps "
                f"after --warmup {cfg.warmup}: raise --steps")
    wanted = {r.strip() for r in cfg.runs.split(",") if r.strip()}
    if not wanted <= set(RUNS):
        p.error(f"--runs: unknown {sorted(wanted - set(RUNS))}; choose from {', '.join(RUNS)}")
    if cfg.no_torchrun:
        wanted.discard("torchrun")
    started = datetime.now(timezone.utc)
    load0 = os.getloadavg()
    reports: list[str] = []
    failed = 0
    shm_dir = Path("/dev/shm") / f"ftrun-bench-fw-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    try:
        with work_dir("ftrun-bench-fw-", cfg.keep) as root:
            for name in names:
                fw = FRAMEWORKS[name]
                variants = [
                    Variant("off", "ftrun, snapshots off", "ftrun"),
                    Variant("auto", "ftrun, snapshots auto", "ftrun", every="auto"),
                    Variant("torchrun", "torchrun", "torchrun"),
                    Variant("ckpt", f"ftrun, snapshots off + {fw.label} checkpoint every "
                            f"{cfg.ckpt_every}", "ftrun", ckpt=True)]
                runs = []
                for v in (v for v in variants if v.key in wanted):
                    r = run_job(cfg, fw, v, root, shm_dir)
                    runs.append(r)
                    failed += not r.ok
                    summary = (f"{figures(r, cfg.warmup).steps_per_s:.2f} steps/s" if r.ok
                               else "FAILED")
                    print(f"{fw.name} / {v.name}: {summary}, {r.wall_s:.1f} s", file=sys.stderr)
                job_args = " ".join(fw.job(cfg, Path("DIR")))
                reports += framework_report(cfg, fw, runs, job_args)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    import torch

    command = " ".join(["python bench/frameworks.py", *(argv if argv is not None
                                                         else sys.argv[1:])])
    lines = [
        "## Framework integrations: snapshot overhead and the frameworks' own checkpoints "
        "(issue 18)", "",
        f"- Command: `{command}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"(1 min) {load0[0]:.2f} at start / {os.getloadavg()[0]:.2f} at end; Python "
        f"{platform.python_version()}, torch {torch.__version__}, lightning "
        f"{version('lightning')}, transformers {version('transformers')}, accelerate "
        f"{version('accelerate')}",
        f"- Code: commit {git_tree()}",
        f"- Method: {cfg.steps} steps per run, measured over steps {cfg.warmup + 1}-{cfg.steps} "
        f"(steps/s per rank, median over ranks). Snapshots off = `--snapshot-every "
        f"{OFF_EVERY}` (the launcher refuses 0). ftrun blocking = time inside "
        "`Snapshotter.save()` and `wait()` (the optimizer pre-hook) in those steps, mean "
        "over ranks. Framework save call = median duration of the save call per rank, the "
        "slowest rank's (rank 0's in brackets); 'step with a save − step without' = "
        "difference of the median step intervals. Checkpoints are written to the local disk "
        "(ext4; no fsync, so mostly the page cache).",
        "",
        *reports,
    ]
    _emit(lines, cfg.output)
    # A failed run is in the report (with its log's path), and in the exit status.
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
