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
- ``ftrun in place + parked workers, kill``: the same with ``FTRUN_PARKED_WORKERS=1``: the
  new process is an interpreter that ran the script up to ``@ftrun.resilient`` ahead;
- ``ftrun process restart, kill``: ``FTRUN_INPLACE_TIMEOUT=0`` (every rank a new process,
  resumed from the snapshot);
- ``torchrun, kill``: ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (new
  processes; the Snapshotter does nothing under torchrun, so the job starts over at step 1).

Every faulted run's final ``params_xxh3`` must equal the fault-free ftrun run's.

``--node-loss`` adds the node-loss case: ``--nproc`` launchers of one rank each on loopback
(``--nnodes N``) plus one more, the spare (whichever joins last); when every rank has logged
step ``--fail-at-step``, the benchmark SIGKILLs a launcher that runs a rank, with its rank
(the process groups of both: torchrun's workers would outlive their agent), as a host that
dies would go. Launcher 0 hosts the rendezvous store (and ftrun's coordinator) and is never
the victim.
"fault -> next step" ends when every rank of the new world has logged a step after the kill
that the old world cannot have logged (another process, a step repeated, or more than one
step past the rank's last one read right after the kill: under load the old world's last
step may be logged after the kill).
Variants: ftrun in place (the survivors drop the lost node from the rendezvous as soon as
the coordinator declares it lost), the same with warm workers (the spare's rank starts from
an interpreter with torch imported ahead) against torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
and ftrun's c10d tuning passed as ``--rdzv-conf`` (keep-alive 2 s x 3, last call 5 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
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
    Variant("ftrun in place + parked workers, kill", "ftrun", "kill",
            {"FTRUN_INPLACE_TIMEOUT": "5", "FTRUN_PARKED_WORKERS": "1"}),
    Variant("ftrun process restart (FTRUN_INPLACE_TIMEOUT=0), kill", "ftrun", "kill",
            {"FTRUN_INPLACE_TIMEOUT": "0"}),
    Variant("torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, kill", "torchrun", "kill",
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
]


# ftrun's c10d tuning (ftrun.launcher.launch.RDZV_TUNING), given to torchrun as --rdzv-conf.
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5"
NODE_LOSS_VARIANTS = [
    Variant("ftrun in place, node loss (spare)", "ftrun", "node", {"FTRUN_INPLACE_TIMEOUT": "5"}),
    Variant("ftrun in place + warm workers, node loss (spare)", "ftrun", "node",
            {"FTRUN_INPLACE_TIMEOUT": "5", "FTRUN_WARM_WORKERS": "1"}),
    Variant("torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, node loss (spare)", "torchrun",
            "node", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
]


@dataclass
class Result:
    digest: str | None
    to_step_s: float | None
    next_step: int | None
    how: str
    wall_s: float


def _log_lines(job: Path, rank: int) -> list[list[str]]:
    """``rank``'s ``step pid time`` lines so far."""
    path = job / f"pids-rank{rank}.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [f for f in (ln.split() for ln in lines) if len(f) == 3]  # a line being written: not yet


def _last_line(job: Path, rank: int) -> list[str]:
    """The newest ``step pid time`` line of ``rank`` (["0", "0", "0"] before its first)."""
    path = job / f"pids-rank{rank}.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return lines[-1].split() if lines else ["0", "0", "0"]


def _last_step(job: Path, rank: int) -> int:
    return int(_last_line(job, rank)[0])


def _descendants(pid: int) -> set[int]:
    """The pids of ``pid``'s descendants (from /proc): a rank may be a warm interpreter's."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        todo += kids - out
        out |= kids
    return out


def run_node_loss(cfg: argparse.Namespace, v: Variant, root: Path) -> Result:
    """The node-loss case (see the module docstring): --nproc launchers of one rank and a
    spare on loopback; launcher 1 killed with its ranks once every rank reached
    --fail-at-step."""
    job = root / uuid.uuid4().hex[:8]
    job.mkdir()
    run_id = f"bench-nodeloss-{job.name}"
    launcher = ([sys.executable, "-m", "ftrun"] if v.launcher == "ftrun"
                else [str(Path(sys.executable).with_name("torchrun")), "--rdzv-conf", RDZV_CONF])
    cmd = [*launcher, "--nnodes", str(cfg.nproc), "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
           "--max-restarts", "2", SCRIPT, "--epochs", str(cfg.epochs), "--samples",
           str(cfg.samples), "--batch-size", "8", "--hidden", "64", "--pid-log", str(job),
           # Steps of a few ms would let the job end before the benchmark's kill lands.
           "--step-sleep", "0.1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "FTRUN_STATE_DIR": str(job / "state"), **v.env}
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    fault = None
    at_kill: dict[int, list[list[str]]] = {}  # rank -> its log lines right after the kill

    def start(i: int) -> None:
        with open(job / f"out{i}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT, start_new_session=True))

    def wait(what: str, ok: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + cfg.job_timeout
        while not ok():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                print(f"  {v.name}: no {what} within {cfg.job_timeout} s", file=sys.stderr)
                return False
            time.sleep(0.05)
        return True

    try:
        start(0)
        time.sleep(2.0)  # launcher 0 binds the rendezvous store first
        for i in range(1, cfg.nproc + 1):  # the last one to join the round is the spare
            start(i)
        if wait(f"step {cfg.fail_at_step}", lambda: min(
                _last_step(job, r) for r in range(cfg.nproc)) >= cfg.fail_at_step):
            ranks = {int(_last_line(job, r)[1]) for r in range(cfg.nproc)}
            victim = next((p for p in procs[1:] if _descendants(p.pid) & ranks), None)
            if victim is None:
                raise RuntimeError(f"no launcher but launcher 0 is the parent of ranks {ranks}")
            fault = time.time()
            # The host dies: its launcher and its rank at once (torchrun's workers outlive
            # a killed agent: they lead sessions of their own).
            doomed = sorted(_descendants(victim.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.pid, signal.SIGKILL)
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # a worker torch started leads its group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Read once the victim is dead: after this the old world can log only the step
            # whose all-reduce ended before the kill.
            at_kill = {r: _log_lines(job, r) for r in range(cfg.nproc)}
            for p in procs:
                try:
                    p.wait(cfg.job_timeout)
                except subprocess.TimeoutExpired:
                    print(f"  {v.name}: a launcher timed out", file=sys.stderr)
                    break
    finally:
        kill_sessions(procs)
    wall = time.monotonic() - t0
    text = "".join((job / f"out{i}.log").read_text() for i in range(len(procs)))
    digests = DIGEST.findall(text)
    to_step, next_step = None, None
    if fault is not None:
        firsts = []
        for rank in range(cfg.nproc):
            lines = _log_lines(job, rank)
            seen = at_kill[rank]
            last_step, last_pid = (int(seen[-1][0]), seen[-1][1]) if seen else (0, "")
            first, prev = None, last_step
            for s, pid, t in lines[len(seen):]:
                # The old world can log only the step whose all-reduce ended before the
                # kill, in the same process, after the one before.
                if pid != last_pid or int(s) <= prev or int(s) > last_step + 1:
                    first = (float(t), int(s))
                    break
                prev = int(s)
            firsts.append(first)
        if all(firsts):
            to_step = max(f[0] for f in firsts if f) - fault
            next_step = max(f[1] for f in firsts if f)
    how = "new processes (torch)" if v.launcher == "torchrun" else "—"
    events = job / "state" / "jobs" / run_id / "events.jsonl"
    if events.exists():
        recs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
        hows = sorted({f"{r['how']} (new: {r.get('new_processes', 'all')})" for r in recs
                       if r.get("type") == "recovery"})
        early = sum(1 for r in recs if r.get("type") == "rendezvous_node_dropped")
        how = ", ".join(hows) + (f"; lost node dropped from the rendezvous early ({early}x)"
                                 if early else "; dropped when its keep-alives expired")
    return Result(digests[-1] if digests else None, to_step, next_step, how, wall)


def run_job(cfg: argparse.Namespace, v: Variant, root: Path) -> Result:
    if v.fail_mode == "node":
        return run_node_loss(cfg, v, root)
    job = root / uuid.uuid4().hex[:8]
    job.mkdir()
    run_id = f"bench-inproc-{job.name}"
    launcher = ([sys.executable, "-m", "ftrun"] if v.launcher == "ftrun"
                else [str(Path(sys.executable).with_name("torchrun"))])
    cmd = [*launcher, "--nnodes", str(cfg.nnodes), "--nproc-per-node",
           str(cfg.nproc // cfg.nnodes), "--rdzv-backend", "c10d",
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
                "--kill-rank", str(cfg.fail_rank), "--fault-at", cfg.fault_at]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "FTRUN_STATE_DIR": str(job / "state"), **v.env}
    t0 = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(cfg.nnodes):  # launcher 0 hosts the rendezvous store
            with open(job / f"out{i}.log", "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, cwd=ROOT, start_new_session=True))
        deadline = time.monotonic() + cfg.job_timeout
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"  {v.name}: timed out after {cfg.job_timeout} s", file=sys.stderr)
                break
    finally:
        kill_sessions(procs)
    wall = time.monotonic() - t0
    text = "".join((job / f"out{i}.log").read_text() for i in range(cfg.nnodes))
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
        found = [r for r in recs if r.get("type") == "recovery"]
        hows = sorted({f"{r['how']} (new: {r.get('new_processes', 'all')})" for r in found})
        worlds = sorted({r["world"] for r in found if r.get("world")})
        phase = max((r.get("rendezvous_s") or 0.0 for r in found), default=None)
        how = ", ".join(hows) or "—"
        if worlds and phase is not None:
            how += f"; world {'/'.join(worlds)}, slowest node's re-formation {phase:.2f} s"
    elif v.launcher == "torchrun" and v.fail_mode:
        how = "new processes (torch)"
    return Result(digests[-1] if digests else None, to_step, next_step, how, wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nproc", type=int, default=3, help="ranks in all")
    p.add_argument("--nnodes", type=int, default=1,
                   help="launchers on this machine (--nproc of them in all; adds the variant "
                        "re-forming through torch's rendezvous, FTRUN_PUSHED_WORLD=0)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=384, help="384/3/8: 16 steps per epoch")
    p.add_argument("--fail-at-step", type=int, default=10)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL, one rank per GPU (--nproc at most the GPUs)")
    p.add_argument("--fail-mode", choices=("kill", "raise", "stop", "hang"),
                   help="every variant fails this way (default: each variant's own; hang: "
                        "ftrun's variants only, torchrun has no hang detection)")
    p.add_argument("--fault-at", choices=("start", "forward", "backward", "optimizer",
                                          "after-step"), default="after-step",
                   help="where in the step the fault lands (examples/user_ddp.py --fault-at; "
                        "start: after the previous save(), before the batch is fetched)")
    p.add_argument("--stop", action="store_true",
                   help="add the SIGSTOP case: ftrun in place, ftrun process restart, and "
                        "torchrun with the script's --pg-timeout")
    p.add_argument("--stop-pg-timeout", type=float, default=15.0,
                   help="torchrun's SIGSTOP case: the process group timeout (default 15 s)")
    p.add_argument("--node-loss", action="store_true",
                   help="add the node-loss case: ftrun in place and torchrun, --nproc "
                        "launchers of one rank and a spare, launcher 1 killed")
    p.add_argument("--only-node-loss", action="store_true",
                   help="run the node-loss case alone")
    p.add_argument("--only", metavar="REGEX",
                   help="run only the variants whose name matches REGEX")
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
    if cfg.nproc % cfg.nnodes:
        p.error(f"--nproc {cfg.nproc} is not a multiple of --nnodes {cfg.nnodes}")
    if cfg.nnodes > 1:
        variants.insert(1, Variant(
            "ftrun in place, torch's rendezvous (FTRUN_PUSHED_WORLD=0), kill", "ftrun", "kill",
            {"FTRUN_INPLACE_TIMEOUT": "5", "FTRUN_PUSHED_WORLD": "0"}))
    if cfg.node_loss:
        variants += NODE_LOSS_VARIANTS
    if cfg.only_node_loss:
        variants = list(NODE_LOSS_VARIANTS)
    if cfg.fail_mode:
        named: dict[str, Variant] = {}
        for v in VARIANTS:
            if cfg.fail_mode == "hang" and v.launcher == "torchrun":
                continue
            name = v.name.rpartition(", ")[0] + f", {cfg.fail_mode}"
            named.setdefault(name, Variant(name, v.launcher, cfg.fail_mode, v.env))
        variants = list(named.values())
    if cfg.only:
        variants = [v for v in variants if re.search(cfg.only, v.name)]
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
        "## Node loss: survivors restart in place, the lost node dropped from the rendezvous "
        "early (issue 17, item 3)" if cfg.only_node_loss else
        "## In-process restart: only the dead rank gets a new process (issue 17)", "",
        f"- Command: `python bench/inprocess.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M} UTC",
        f"- Host: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load "
        f"average (1 min) {load0:.2f} at start / {os.getloadavg()[0]:.2f} at end, Python "
        f"{platform.python_version()}, torch {torch.__version__}",
        f"- Code: commit {commit}",
        f"- Job: `examples/user_ddp.py --epochs {cfg.epochs} --samples {cfg.samples} "
        f"--batch-size 8 --hidden 64` ({'NCCL, GPU' if cfg.device == 'cuda' else 'gloo, CPU'}), "
        f"{cfg.nnodes} launcher(s) x {cfg.nproc // cfg.nnodes} rank(s), c10d "
        f"rendezvous, `--max-restarts 1`; rank {cfg.fail_rank} fails in step "
        f"{cfg.fail_at_step} (`--fault-at {cfg.fault_at}`); {cfg.repeats} repeat(s), variants interleaved. \"fault -> next "
        "step\": from the fault marker (written just before the kill or raise) until every "
        "rank logged a step after it. Fault-free run: "
        f"{base.wall_s:.1f} s, params_xxh3 {base.digest}." + (
            f" Node loss: {cfg.nproc} launchers x 1 rank (`--nnodes {cfg.nproc}`, the script "
            "with `--step-sleep 0.1`) and a spare "
            "on loopback; a launcher with a rank (never launcher 0, the store's) SIGKILLed with "
            "its rank (both process groups) once every "
            f"rank logged step {cfg.fail_at_step}; next step: every rank logged a step of the new "
            "world after the kill; torchrun gets `--rdzv-conf "
            f"{RDZV_CONF}` (ftrun's tuning)." if any(v.fail_mode == "node" for v in variants)
            else ""), "",
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
