"""Benchmark: time from a worker failure to the next completed training step, ftrun vs torchrun.

One command runs the same job under every launcher, side by side, repeats interleaved::

    .venv/bin/python bench/restart.py [--repeats 3] [--nodes 2] [--output bench/RESULTS.md]

The job is ``examples/train.py`` (unchanged, through ``bench/_timed_train.py``, which logs a
wall-clock timestamp per completed step) on ``--nodes`` launcher processes on localhost
(``--nnodes N --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``,
``--max-restarts 1``). Rank ``--fail-rank`` SIGKILLs itself in step ``--fail-at-step``; the fault
marker it writes just before holds the time of the kill. The measured interval ends when every
rank of the restarted world has completed its first step (the latest of the ranks' first
post-restart steps; a process counts as restarted when it started after the kill). A second
interval ends when every rank has completed the failed step again: it adds the work lost to the
fault (ftrun's ranks resume from their newest snapshot, torchrun's from step 1).

Launchers, all at their defaults apart from the job's flags:

- ``ftrun``;
- ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the best a torchrun user can do;
- ``torchrun`` as is. Its shared rendezvous store hands restarted ranks stale gloo addresses,
  so the restart fails or hangs; a job with no resumed step ``--resume-timeout`` seconds after
  the kill is killed. Either way it is reported as "did not resume".

A second case freezes the rank with SIGSTOP instead: ftrun with ``--hang-timeout`` against
torchrun (with the variable) relying on the script's ``--pg-timeout`` (both jobs get it).

Every faulted run's final ``params_xxh3`` must equal the fault-free run's of the same launcher.
The code under test (the ``ftrun`` package, ``examples/train.py`` and the driver) is copied into
the work directory at start and imported from there (``PYTHONPATH`` and working directory), so
every run measures the same code even while the tree is being edited; the report names the
commit and a digest of the copy, and a run whose ranks imported another ``ftrun`` is rejected.
Each launcher starts in its own session; on a timeout or an error its process group, and every
process that carries this job's private step-log path in its environment (torch starts workers
in sessions of their own), is killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from ftrun.testing import free_port, freeze_code, git_tree, kill_sessions, read_jsonl, work_dir

ROOT = Path(__file__).resolve().parent.parent
# Copied into the work directory at start, so every run measures the same code even while the
# tree is being edited: the ftrun package, the job and the step-timing driver.
FROZEN = ("ftrun", "examples/train.py", "bench/_timed_train.py")
DRIVER = "bench/_timed_train.py"
STEPLOG_ENV = "FTRUN_BENCH_STEPLOG"
HEADING = "Restart after a worker failure (issue: launcher)"
POLL_S = 0.1


# --------------------------------------------------------------------------------------------
# Launchers and jobs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One way of launching the job."""

    key: str
    label: str
    launcher: str  # "ftrun" or "torchrun"
    env: dict[str, str] = field(default_factory=dict)


FTRUN = Variant("ftrun", "ftrun (in place: `@ftrun.resilient`)", "ftrun")
FTRUN_PROCESS = Variant(
    "ftrun-process",
    "ftrun, process restart (`FTRUN_INPLACE_TIMEOUT=0`)",
    "ftrun",
    {"FTRUN_INPLACE_TIMEOUT": "0"},
)
TORCHRUN_NOSHARE = Variant(
    "torchrun-noshare",
    "torchrun + `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`",
    "torchrun",
    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
)
TORCHRUN = Variant("torchrun", "torchrun (as is)", "torchrun")
KILL_VARIANTS = (FTRUN, FTRUN_PROCESS, TORCHRUN_NOSHARE, TORCHRUN)
STOP_VARIANTS = (FTRUN, FTRUN_PROCESS, TORCHRUN_NOSHARE)


@dataclass(frozen=True)
class JobSpec:
    variant: Variant
    fault: str | None  # None, "kill" or "stop"
    train_extra: tuple[str, ...] = ()
    launcher_extra: tuple[str, ...] = ()
    resume_timeout_s: float = 60.0
    job_timeout_s: float = 300.0


@dataclass
class JobResult:
    spec: JobSpec
    outcome: str = "ok"  # ok | no-resume | failed | timeout
    exit_codes: list[int | None] = field(default_factory=list)
    wall_s: float | None = None  # launch to the last launcher's exit (None when killed)
    fault_ts: float | None = None
    respawn_ts: float | None = None  # every rank's restarted process is running
    resume_ts: float | None = None  # every rank completed its first post-restart step
    detect_ts: float | None = None  # ftrun only: first failure/hang event after the fault
    resume_step: int | None = None  # the step number of that first post-restart step
    caught_up_ts: float | None = None  # every rank completed the failed step again
    last_step_ts: float | None = None  # the last step any rank completed
    end_ts: float | None = None  # every launcher has exited
    digest: str | None = None
    restart_count: int | None = None
    leftovers: int = 0
    killed_launchers: int = 0  # launchers still running when the benchmark gave up
    shm_leftovers: int = 0  # snapshot segments left in /dev/shm (removed by the benchmark)
    log_tail: str = ""

    @property
    def to_step_s(self) -> float | None:
        if self.fault_ts is None or self.resume_ts is None:
            return None
        return self.resume_ts - self.fault_ts

    @property
    def teardown_s(self) -> float | None:
        if self.last_step_ts is None or self.end_ts is None:
            return None
        return self.end_ts - self.last_step_ts

    @property
    def to_caught_up_s(self) -> float | None:
        if self.fault_ts is None or self.caught_up_ts is None:
            return None
        return self.caught_up_ts - self.fault_ts

    @property
    def to_respawn_s(self) -> float | None:
        if self.fault_ts is None or self.respawn_ts is None:
            return None
        return self.respawn_ts - self.fault_ts

    @property
    def to_detect_s(self) -> float | None:
        if self.fault_ts is None or self.detect_ts is None:
            return None
        return self.detect_ts - self.fault_ts


def launcher_cmd(launcher: str) -> list[str]:
    """The venv's console script when it sits next to this interpreter, else ``-m``."""
    script = Path(sys.executable).parent / launcher
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    module = "ftrun" if launcher == "ftrun" else "torch.distributed.run"
    return [sys.executable, "-m", module]


def job_env(variant: Variant, job_dir: Path, steplog: Path, code: Path) -> dict[str, str]:
    """This process's environment minus launcher settings, plus the job's private paths."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FTRUN_", "PET_", "TORCHELASTIC_"))
        and k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    }
    env.update(
        PYTHONUNBUFFERED="1",
        # Ahead of the editable install: launchers and ranks import the frozen ftrun.
        PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
        FTRUN_STATE_DIR=str(job_dir / "state"),
        TMPDIR=str(job_dir / "t"),
        **{STEPLOG_ENV: str(steplog)},
        **variant.env,
    )
    return env


def remove_shm(run_id: str) -> int:
    """Delete the job's snapshot segments left in /dev/shm; returns how many there were.

    The job environment drops every ``FTRUN_*`` variable, so segments live in the default
    ``/dev/shm``, named by ftrun's per-job prefix (nothing to do with an ftrun that has none).
    """
    try:
        from ftrun.snapshot.segment import job_prefix
    except ImportError:
        return 0
    prefix = job_prefix(run_id)
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


@dataclass
class Recovery:
    """When the restarted world got where; each None until every rank of the world did."""

    respawn: float | None = None  # every rank's new process started
    resume: float | None = None  # every rank completed its first step
    resume_step: int | None = None  # the number of that step
    caught_up: float | None = None  # every rank completed the failed step (or a later one)


def recovery(
    records: list[dict[str, Any]], fault_ts: float, world: int, fail_step: int
) -> Recovery:
    """Read the restart off the step log: a record belongs to the restarted world when its
    restart count is above 0 (a new process, or a process kept by an in-place restart, whose
    TORCHELASTIC_RESTART_COUNT is updated in place) or its process started after
    ``fault_ts``."""
    new_pids = {r["pid"] for r in records if r["ev"] == "start" and r["t"] > fault_ts}
    first_start: dict[int, float] = {}
    first_step: dict[int, tuple[float, int]] = {}
    caught_up: dict[int, float] = {}
    for r in records:
        if r["pid"] not in new_pids and not (r.get("restart", 0) > 0 and r["t"] > fault_ts):
            continue
        rank, t = r["rank"], r["t"]
        if r["ev"] in ("start", "run"):
            first_start[rank] = min(first_start.get(rank, t), t)
        elif r["ev"] == "step":
            if rank not in first_step or t < first_step[rank][0]:
                first_step[rank] = (t, int(r["step"]))
            if r["step"] >= fail_step:
                caught_up[rank] = min(caught_up.get(rank, t), t)
    out = Recovery()
    if len(first_start) == world:
        out.respawn = max(first_start.values())
    if len(first_step) == world:
        out.resume, out.resume_step = max(first_step.values())
    if len(caught_up) == world:
        out.caught_up = max(caught_up.values())
    return out


def ftrun_detect_ts(state_dir: Path, run_id: str, fault_ts: float) -> float | None:
    path = state_dir / "jobs" / run_id / "events.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    times = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            ev = json.loads(line)
            if ev["type"] in ("worker_failure", "hang_detected") and ev["ts"] >= fault_ts:
                times.append(float(ev["ts"]))
    return min(times) if times else None


def run_job(cfg: argparse.Namespace, spec: JobSpec, root: Path, code: Path) -> JobResult:
    """Run one job to its end (or its timeout); always leaves no process behind."""
    run_id = f"b-{spec.variant.key}-{spec.fault or 'clean'}-{uuid.uuid4().hex[:6]}"
    # Short paths: ftrun puts unix sockets under TMPDIR (sun_path holds 107 bytes).
    job_dir = root / f"{sum(1 for p in root.iterdir() if p.name.isdigit()):02d}"
    (job_dir / "t").mkdir(parents=True)
    (job_dir / "faults").mkdir()
    steplog = job_dir / "steps.jsonl"
    result_file = job_dir / "result.json"
    env = job_env(spec.variant, job_dir, steplog, code)
    token = f"{STEPLOG_ENV}={steplog}".encode()
    world = cfg.nodes * cfg.nproc_per_node

    train = [
        str(code / DRIVER), "--steps", str(cfg.steps), "--step-sleep", str(cfg.step_sleep),
        "--result", str(result_file), "--fault-dir", str(job_dir / "faults"),
        "--snapshot-every", "1", *spec.train_extra,
    ]
    if spec.fault:
        train += ["--fail-at-step", str(cfg.fail_at_step), "--fail-rank", str(cfg.fail_rank),
                  "--fail-mode", spec.fault]
    cmd = [
        *launcher_cmd(spec.variant.launcher),
        "--nnodes", str(cfg.nodes), "--nproc-per-node", str(cfg.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", run_id, "--max-restarts", "1", *spec.launcher_extra, *train,
    ]
    res = JobResult(spec)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[TextIO] = []
    marker = job_dir / "faults" / f"fault-fired-rank{cfg.fail_rank}-step{cfg.fail_at_step}"
    t_launch = time.time()
    try:
        for i in range(cfg.nodes):
            log = open(job_dir / f"node{i}.log", "w")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            procs.append(subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=code, start_new_session=True,
            ))
        deadline = t_launch + spec.job_timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                res.end_ts = time.time()
                res.wall_s = res.end_ts - t_launch
                break
            now = time.time()
            if spec.fault and res.fault_ts is None and marker.exists():
                with contextlib.suppress(OSError, ValueError, KeyError):
                    res.fault_ts = float(json.loads(marker.read_text())["time"])
            if (
                res.fault_ts is not None
                and now > res.fault_ts + spec.resume_timeout_s
                and recovery(read_jsonl(steplog), res.fault_ts, world, 1).resume is None
            ):
                res.outcome = "no-resume"
                break
            if now > deadline:
                res.outcome = "timeout"
                break
            time.sleep(POLL_S)
    finally:
        res.killed_launchers = sum(1 for p in procs if p.poll() is None)
        leftovers = kill_sessions(procs, token, timeout_s=10)
        if not res.killed_launchers:
            res.leftovers = leftovers  # processes that outlived their launchers
        res.shm_leftovers = remove_shm(run_id)
        for log in logs:
            log.close()
    res.exit_codes = [p.returncode for p in procs]

    if spec.fault and res.fault_ts is None and marker.exists():
        with contextlib.suppress(OSError, ValueError, KeyError):
            res.fault_ts = float(json.loads(marker.read_text())["time"])
    records = read_jsonl(steplog)
    foreign = {r.get("ftrun") for r in records if r["ev"] == "start"} - {str(code / "ftrun")}
    if foreign:
        res.outcome = f"wrong ftrun imported: {sorted(map(str, foreign))}"
    steps = [r["t"] for r in records if r["ev"] == "step"]
    res.last_step_ts = max(steps) if steps else None
    if res.fault_ts is not None:
        rec = recovery(records, res.fault_ts, world, cfg.fail_at_step)
        res.respawn_ts, res.resume_ts, res.resume_step = rec.respawn, rec.resume, rec.resume_step
        res.caught_up_ts = rec.caught_up
        if spec.variant.launcher == "ftrun":
            res.detect_ts = ftrun_detect_ts(job_dir / "state", run_id, res.fault_ts)
    with contextlib.suppress(OSError, ValueError, KeyError):
        data = json.loads(result_file.read_text())
        res.digest, res.restart_count = data["params_xxh3"], int(data["restart_count"])
    if res.outcome == "ok" and (any(c != 0 for c in res.exit_codes) or res.digest is None):
        res.outcome = "failed"
    if spec.fault and res.fault_ts is None and res.outcome == "ok":
        res.outcome = "failed"  # the fault never fired: the run measured nothing
    if res.outcome != "ok":
        tails = []
        for i in range(cfg.nodes):
            with contextlib.suppress(OSError):
                tails.append(f"--- node{i} ---\n" + (job_dir / f"node{i}.log").read_text()[-2500:])
        res.log_tail = "\n".join(tails)
    return res


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def spread(values: list[float]) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f} s"
    return f"{med:.2f} s ({min(values):.2f}–{max(values):.2f})"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary_table(
    variants: Sequence[Variant],
    runs: dict[str, list[JobResult]],
    clean: dict[str, JobResult],
    what: str,
    cfg: argparse.Namespace,
    timeout_s: float,
) -> list[str]:
    head = (
        f"| launcher | {what} → next step, median (min–max) | resumed | next step"
        f" | {what} → step {cfg.fail_at_step} done again | {what} → ranks respawned"
        " | respawned → step | ftrun: detected after | job wall time | last step → exit"
        " | fault-free wall time | final params = fault-free |"
    )
    lines = [head, "|" + "---|" * 12]
    for v in variants:
        rs = runs.get(v.key, [])
        ok = [r for r in rs if r.to_step_s is not None]
        steps = [r.to_step_s for r in ok if r.to_step_s is not None]
        main = spread(steps)
        missing = Counter(r.outcome for r in rs if r.to_step_s is None)
        if missing:
            main = "; ".join(
                (f"did not resume within {timeout_s:.0f} s" if outcome == "no-resume"
                 else "job failed, no step after the restart" if outcome == "failed"
                 else outcome) + f" ({n}/{len(rs)} runs)"
                for outcome, n in missing.items()
            )
            if ok:
                main += f"; resumed runs: {spread(steps)}"
        caught_up = [r.to_caught_up_s for r in ok if r.to_caught_up_s is not None]
        respawn = [r.to_respawn_s for r in ok if r.to_respawn_s is not None]
        init = [r.resume_ts - r.respawn_ts for r in ok
                if r.resume_ts is not None and r.respawn_ts is not None]
        detect = [r.to_detect_s for r in rs if r.to_detect_s is not None]
        walls = [r.wall_s for r in rs if r.outcome == "ok" and r.wall_s is not None]
        wall = spread(walls) if walls else ""
        bad = Counter(r.outcome for r in rs if r.outcome != "ok")
        if bad:
            wall += "; " if wall else ""
            wall += "; ".join(
                f"{n}/{len(rs)} killed at the resume timeout" if o == "no-resume"
                else f"{n}/{len(rs)} {o}" for o, n in bad.items()
            )
        at = sorted({r.resume_step for r in ok if r.resume_step is not None})
        resumed_at = ", ".join(str(x) for x in at) or "—"
        teardown = [r.teardown_s for r in rs if r.outcome == "ok" and r.teardown_s is not None]
        base = clean.get(v.key)
        finished = [r for r in rs if r.digest is not None]
        same = sum(1 for r in finished if base is not None and r.digest == base.digest)
        if not finished:
            params = "— (no run finished)"
        elif same == len(finished):
            params = f"yes ({same}/{len(finished)})"
        else:
            params = f"**NO** ({same}/{len(finished)} equal)"
        lines.append(
            f"| {v.label} | {main} | {len(ok)}/{len(rs)} | {resumed_at}"
            f" | {spread(caught_up)} | {fmt_s(median(respawn))}"
            f" | {fmt_s(median(init))} | {fmt_s(median(detect)) if v.launcher == 'ftrun' else '—'}"
            f" | {wall} | {fmt_s(median(teardown))}"
            f" | {fmt_s(base.wall_s if base and base.outcome == 'ok' else None)} | {params} |"
        )
    return lines


def per_run_lines(variants: Sequence[Variant], runs: dict[str, list[JobResult]]) -> list[str]:
    out = []
    for v in variants:
        cells = []
        for r in runs.get(v.key, []):
            cell = "—" if r.to_step_s is None else f"{r.to_step_s:.2f}"
            if r.outcome != "ok":
                cell += f" ({r.outcome}, exit codes {r.exit_codes})"
            cells.append(cell)
        out.append(f"- {v.label}: {', '.join(cells) or '—'}")
    return out


def ratio_line(runs: dict[str, list[JobResult]], what: str, cfg: argparse.Namespace) -> str:
    """ftrun's medians over torchrun's (with the variable), in place and with new processes."""
    def med(key: str, attr: str) -> float | None:
        return median([x for r in runs.get(key, []) if (x := getattr(r, attr)) is not None])

    parts = []
    for attr, end in (("to_step_s", "next step"),
                      ("to_caught_up_s", f"step {cfg.fail_at_step} done again")):
        b = med(TORCHRUN_NOSHARE.key, attr)
        cells = []
        for v, name in ((FTRUN, "in place"), (FTRUN_PROCESS, "process restart")):
            a = med(v.key, attr)
            cells.append(f"{name} n/a" if a is None or b is None or b <= 0
                         else f"{name} **{a / b:.2f}×** ({a:.2f} s / {b:.2f} s)")
        parts.append(f"median {what} → {end}: " + ", ".join(cells))
    return "Ratio ftrun / torchrun (with the variable): " + "; ".join(parts) + "."


def kill_variants(cfg: argparse.Namespace) -> tuple[Variant, ...]:
    return tuple(v for v in KILL_VARIANTS if not (cfg.no_plain and v is TORCHRUN))


def plain_outcome(runs: dict[str, list[JobResult]], timeout_s: float) -> str:
    rs = runs.get(TORCHRUN.key, [])
    if not rs:
        return "torchrun as is: not measured."
    resumed = [r for r in rs if r.to_step_s is not None]
    states = []
    for r in rs:
        if r.to_step_s is not None:
            continue
        if r.killed_launchers:
            states.append(f"no step within {timeout_s:.0f} s of the fault, "
                          f"{r.killed_launchers} of {len(r.exit_codes)} launchers still running "
                          f"(killed)")
        elif r.fault_ts is not None and r.end_ts is not None:
            states.append(f"the restarted job failed: launchers exited with {r.exit_codes} "
                          f"{r.end_ts - r.fault_ts:.0f} s after the fault")
        else:
            states.append(f"{r.outcome}, exit codes {r.exit_codes}")
    detail = "; ".join(f"{n}× {state}" for state, n in Counter(states).items())
    if not resumed:
        return f"torchrun as is: **did not resume** in {len(rs)}/{len(rs)} runs ({detail})."
    text = (f"torchrun as is: resumed in {len(resumed)}/{len(rs)} runs, median "
            f"{median([r.to_step_s for r in resumed if r.to_step_s is not None]):.2f} s")
    return text + (f"; did not resume in the others ({detail})." if detail else ".")


def render(
    cfg: argparse.Namespace,
    clean: dict[str, JobResult],
    kill_runs: dict[str, list[JobResult]],
    stop_runs: dict[str, list[JobResult]],
    meta: dict[str, str],
) -> str:
    world = cfg.nodes * cfg.nproc_per_node
    lines = [
        f"## {HEADING}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date (UTC): {meta['date']}",
        f"- Host: {meta['host']}",
        f"- Code: commit {meta['tree']}",
        f"- Job: `examples/train.py --steps {cfg.steps} --step-sleep {cfg.step_sleep} "
        "--snapshot-every 1` "
        f"(via `bench/_timed_train.py`) on {cfg.nodes} launchers × {cfg.nproc_per_node} ranks "
        f"on localhost (world {world}), c10d rendezvous, `--max-restarts 1`; rank "
        f"{cfg.fail_rank} fails in step {cfg.fail_at_step}; {cfg.repeats} repeat(s), "
        "launchers interleaved.",
        "- \"→ next step\": from the fault (time in the fault marker, written just before the "
        "signal) until every rank of the restarted world completed its first step; \"next "
        "step\" is that step's number (train.py snapshots every step under ftrun and resumes "
        "from the newest committed snapshot; under torchrun it starts over at step 1), and "
        f"\"step {cfg.fail_at_step} done again\" runs until every rank completed the failed "
        "step again (the lost work redone). "
        "\"ranks respawned\": the last restarted rank's process started; \"respawned → step\": "
        "worker start-up (imports, `init_process_group`, model, step 1). \"ftrun: detected "
        "after\": first `worker_failure`/`hang_detected` event in ftrun's event log. \"last step "
        "→ exit\": from the job's last completed step until every launcher exited. Times are "
        "medians over the runs, (min–max) where there is more than one.",
        "",
        f"### Worker killed (SIGKILL in step {cfg.fail_at_step})",
        "",
        *summary_table(kill_variants(cfg), kill_runs, clean, "kill", cfg, cfg.resume_timeout),
        "",
        ratio_line(kill_runs, "kill", cfg),
        "",
        plain_outcome(kill_runs, cfg.resume_timeout) if not cfg.no_plain
        else "torchrun as is: not measured (--no-plain).",
        "",
        "Per run, kill → next step (s):",
        "",
        *per_run_lines(KILL_VARIANTS, kill_runs),
    ]
    if not cfg.no_stop:
        lines += [
            "",
            f"### Worker frozen (SIGSTOP in step {cfg.fail_at_step})",
            "",
            f"Both jobs run `train.py --pg-timeout {cfg.stop_pg_timeout:g}`; ftrun adds "
            f"`--hang-timeout {cfg.hang_timeout:g}`. torchrun only learns of the fault when the "
            "other ranks' collectives time out. The fault-free reference is the kill case's "
            "(the process-group timeout does not change the parameters).",
            "",
            *summary_table(STOP_VARIANTS, stop_runs, clean, "stop", cfg,
                           cfg.stop_resume_timeout),
            "",
            ratio_line(stop_runs, "stop", cfg),
            "",
            "Per run, stop → next step (s):",
            "",
            *per_run_lines(STOP_VARIANTS, stop_runs),
        ]
    digests = {k: r.digest for k, r in clean.items() if r.digest}
    lines += [
        "",
        "Fault-free params_xxh3: "
        + ", ".join(f"{k} `{d}`" for k, d in digests.items())
        + (" (equal across launchers)." if len(set(digests.values())) == 1
           else " (**differ across launchers**)."),
    ]
    every = [r for rs in (*kill_runs.values(), *stop_runs.values(), [*clean.values()])
             for r in rs]
    if any(r.leftovers for r in every):
        lines.append("")
        lines.append("Processes that outlived their launchers (killed by the benchmark): "
                     + ", ".join(f"{r.spec.variant.key}/{r.spec.fault}: {r.leftovers}"
                                 for r in every if r.leftovers))
    if any(r.shm_leftovers and not r.killed_launchers for r in every):
        lines.append("")
        lines.append("Snapshot segments left in /dev/shm after the launchers exited (removed by "
                     "the benchmark): "
                     + ", ".join(f"{r.spec.variant.key}/{r.spec.fault}: {r.shm_leftovers}"
                                 for r in every if r.shm_leftovers and not r.killed_launchers))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time from a worker failure to the next completed training step: ftrun vs "
        "torchrun, same job, side by side.",
    )
    p.add_argument("--repeats", type=int, default=3, help="faulted runs per launcher (default 3)")
    p.add_argument("--nodes", type=int, default=2, help="launcher processes (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per launcher (default 2)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--fail-at-step", type=int, default=10, help="faulty step (default 10)")
    p.add_argument("--fail-rank", type=int, default=1, help="faulty global rank (default 1)")
    p.add_argument("--step-sleep", type=float, default=0.1,
                   help="train.py --step-sleep, seconds (default 0.1)")
    p.add_argument("--resume-timeout", type=float, default=60.0,
                   help="kill case: give up this long after the kill (default 60 s)")
    p.add_argument("--stop-resume-timeout", type=float, default=150.0,
                   help="stop case: give up this long after the stop (default 150 s)")
    p.add_argument("--hang-timeout", type=float, default=3.0,
                   help="stop case: ftrun --hang-timeout (default 3 s)")
    p.add_argument("--stop-pg-timeout", type=float, default=15.0,
                   help="stop case: train.py --pg-timeout for both launchers (default 15 s)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="hard limit per job (default 300 s)")
    p.add_argument("--no-stop", action="store_true", help="skip the SIGSTOP case")
    p.add_argument("--no-plain", action="store_true", help="skip torchrun without the variable")
    p.add_argument("--output", metavar="FILE",
                   help="also append the report (with command and date) to FILE")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args(argv)
    world = args.nodes * args.nproc_per_node
    if args.repeats < 1 or args.nodes < 1 or args.nproc_per_node < 1:
        p.error("--repeats, --nodes and --nproc-per-node must be >= 1")
    if not 0 <= args.fail_rank < world:
        p.error(f"--fail-rank must be in 0..{world - 1}")
    if not 1 <= args.fail_at_step < args.steps:
        p.error("--fail-at-step must be in 1..steps-1")
    if 8 % world:
        p.error(f"train.py's global batch (8) must be divisible by the world size ({world})")
    return args


def _command_line() -> str:
    exe = sys.executable
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(exe)
        if not rel.startswith(".."):
            exe = rel
    return shlex.join([exe, *sys.argv])


def _progress(tag: str, r: JobResult) -> None:
    parts = [f"[{tag}] {r.spec.variant.key}: {r.outcome}"]
    if r.to_step_s is not None:
        parts.append(f"{r.spec.fault}->step {r.to_step_s:.2f} s")
    if r.wall_s is not None:
        parts.append(f"wall {r.wall_s:.1f} s")
    parts.append(f"exit {r.exit_codes} params {r.digest}")
    print(", ".join(parts), file=sys.stderr, flush=True)
    if r.outcome not in ("ok", "no-resume") and r.log_tail:
        print(r.log_tail, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    import torch  # only for the report's host line

    load = f"{os.getloadavg()[0]:.2f}"
    meta = {
        "command": _command_line(),
        "tree": git_tree(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        "load average (1 min) {load} at start / {load_end} at end, Python "
        f"{platform.python_version()}, torch {torch.__version__}",
    }
    kills = kill_variants(cfg)
    clean: dict[str, JobResult] = {}
    kill_runs: dict[str, list[JobResult]] = {}
    stop_runs: dict[str, list[JobResult]] = {}
    stop_args = ("--pg-timeout", f"{cfg.stop_pg_timeout:g}")

    with work_dir("ftb-", cfg.keep) as root:
        code = root / "code"
        meta["tree"] += f"; measured from a copy taken at start (sha256 {freeze_code(code, FROZEN)})"
        for v in kills:
            r = run_job(cfg, JobSpec(v, None, job_timeout_s=cfg.job_timeout), root, code)
            clean[v.key] = r
            _progress("fault-free", r)
        for i in range(cfg.repeats):
            for v in kills:
                spec = JobSpec(v, "kill", resume_timeout_s=cfg.resume_timeout,
                               job_timeout_s=cfg.job_timeout)
                r = run_job(cfg, spec, root, code)
                kill_runs.setdefault(v.key, []).append(r)
                _progress(f"kill {i + 1}/{cfg.repeats}", r)
        if not cfg.no_stop:
            for i in range(cfg.repeats):
                for v in STOP_VARIANTS:
                    extra = (("--hang-timeout", f"{cfg.hang_timeout:g}") if v.launcher == "ftrun"
                             else ())
                    spec = JobSpec(v, "stop", train_extra=stop_args, launcher_extra=extra,
                                   resume_timeout_s=cfg.stop_resume_timeout,
                                   job_timeout_s=cfg.job_timeout)
                    r = run_job(cfg, spec, root, code)
                    stop_runs.setdefault(v.key, []).append(r)
                    _progress(f"stop {i + 1}/{cfg.repeats}", r)

    meta["host"] = meta["host"].format(load=load, load_end=f"{os.getloadavg()[0]:.2f}")
    report = render(cfg, clean, kill_runs, stop_runs, meta)
    sys.stdout.write(report)
    if cfg.output:
        out = Path(cfg.output)
        sep = "\n" if out.exists() and out.stat().st_size else ""
        with out.open("a") as f:
            f.write(sep + report)
    broken = [r for rs in (*kill_runs.values(), *stop_runs.values()) for r in rs
              if r.digest is not None and clean.get(r.spec.variant.key) is not None
              and r.digest != clean[r.spec.variant.key].digest]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
