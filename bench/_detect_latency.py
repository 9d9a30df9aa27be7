"""bench/detect.py, part "latency": from a hang to resumed training, ftrun against torchrun.

One node, ``--nproc-per-node 3`` (gloo), ``examples/train.py`` with a snapshot every step.
Rank 1 hangs in step ``fail_at`` in one of two ways:

- ``stop``: SIGSTOP (a frozen process: its collective reports stop);
- ``collective-hang``: it enters an all-reduce no other rank enters and never returns.

Per launcher and fault, the seconds from the fault (its marker's timestamp) to the
detection (ftrun's ``detection`` event), to the restarted workers (``workers_started``) and
to the first step completed after the restart. Every ftrun run that recovers must end with
the fault-free ``params_xxh3``; torchrun's restart reduces its first step with DDP's initial
bucket layout, so with 3 ranks its weights differ in the last bits (noted, not an error).
The launchers:

- ftrun with collective detection (``--on-hang restart``, the default);
- ftrun with detection off (``--on-hang warn``): only the launcher's own check, which kills
  a stopped rank after 10 s and cannot see a rank stuck in a collective;
- torchrun with a tuned process-group timeout (``--pg-timeout 15``: the collective the others
  wait in times out, they fail, torchrun restarts everyone) and torch.save every 5 steps;
- torchrun with torch's default timeout (1800 s for gloo), cut off after ``limit_s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ftrun.testing import TOKEN_ENV, kill_sessions, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
VENV = Path(sys.executable).parent
FAULTS = ("stop", "collective-hang")


def _run(name: str, launcher: list[str], train_args: list[str], work: Path,
         env: dict[str, str], limit_s: float) -> dict[str, Any]:
    """Run one job to its end or ``limit_s``; its steps, result (or None) and log."""
    log = work / f"{name}.log"
    steplog = work / f"{name}.steps"
    result = work / f"{name}.json"
    cmd = [*launcher, TRAIN, *train_args, "--step-log", str(steplog), "--result", str(result)]
    t0 = time.time()
    # Every process of the job carries this in its environment: torch starts the workers in
    # sessions of their own, and a frozen one outlives a killed launcher.
    token = f"{TOKEN_ENV}={name}-{uuid.uuid4().hex[:8]}"
    key, value = token.split("=", 1)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **env, key: value}, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_sessions([proc], token.encode())  # its session, then stragglers by token
    steps = read_jsonl(steplog)
    done = json.loads(result.read_text()) if code == 0 and result.exists() else None
    return {"code": code, "steps": steps, "result": done, "log": str(log),
            "wall_s": time.time() - t0}


def _events(state: Path, since: float) -> list[dict[str, Any]]:
    out = []
    for path in state.rglob("events.jsonl"):
        out += [e for e in read_jsonl(path) if e.get("ts", 0) >= since]
    return sorted(out, key=lambda e: e["ts"])


def measure_one(label: str, launcher: list[str], fault: str, base: list[str], fail_at: int,
                work: Path, env: dict[str, str], limit_s: float,
                clean_hash: str | None) -> dict[str, Any]:
    name = f"{uuid.uuid4().hex[:6]}"
    fault_dir = work / f"{name}-fault"
    args = [*base, "--fail-at-step", str(fail_at), "--fail-rank", "1", "--fail-mode", fault,
            "--fault-dir", str(fault_dir)]
    if "torchrun" in label:
        args += ["--snapshot-every", "0", "--torch-save-every", "5",
                 "--torch-save-dir", str(work / f"{name}-ckpt")]
    t0 = time.time()
    job = _run(name, launcher, args, work, env, limit_s)
    row: dict[str, Any] = {"launcher": label, "fault": fault, "wall_s": round(job["wall_s"], 1)}
    marker = fault_dir / f"fault-fired-rank1-step{fail_at}"
    if not marker.exists():
        row["error"] = f"the fault never fired; see {job['log']}"
        return row
    t_fault = json.loads(marker.read_text().splitlines()[0])["time"]
    after = [s for s in job["steps"] if s["restart"] >= 1]
    row["resumed_s"] = round(after[0]["time"] - t_fault, 2) if after else None
    if "FTRUN_STATE_DIR" in env:
        events = _events(Path(env["FTRUN_STATE_DIR"]), t0)
        det = [e for e in events if e["type"] == "detection" and e["ts"] >= t_fault]
        started = [e for e in events if e["type"] == "workers_started" and e["ts"] > t_fault]
        row["detected_s"] = round(det[0]["ts"] - t_fault, 2) if det else None
        row["named"] = det[0]["ranks"] if det else None
        row["restarted_s"] = round(started[0]["ts"] - t_fault, 2) if started else None
    if job["result"] is None:
        row["note"] = (f"no recovery within the {limit_s:g} s limit" if job["code"] is None
                       else f"exit {job['code']}")
    elif clean_hash is not None and job["result"]["params_xxh3"] != clean_hash:
        if "torchrun" in label:
            # Expected of a plain restart with 3+ ranks: DDP reduces the first step after it
            # with its initial bucket layout, not the rebuilt one (see ftrun/_torch.py).
            row["note"] = "recovered; weights differ from the fault-free run (DDP buckets)"
        else:
            row["error"] = (f"params_xxh3 {job['result']['params_xxh3']} differs from the "
                            f"fault-free {clean_hash}")
    elif clean_hash is not None:
        row["note"] = "recovered; weights equal the fault-free run's"
    else:
        row["note"] = "recovered"
    return row


def latency(work: Path, *, steps: int = 30, fail_at: int = 10, step_sleep: float = 0.1,
            limit_s: float = 150.0, faults: tuple[str, ...] = FAULTS) -> list[dict[str, Any]]:
    """Every launcher x fault once; rows as described in the module docstring."""
    state = {"FTRUN_STATE_DIR": str(work / "state")}
    base = ["--steps", str(steps), "--step-sleep", str(step_sleep), "--snapshot-every", "1"]
    ftrun = [str(VENV / "ftrun"), "--standalone", "--nproc-per-node", "3", "--max-restarts", "2"]
    torchrun = [str(VENV / "torchrun"), "--standalone", "--nproc-per-node", "3",
                "--max-restarts", "2"]
    torch_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    clean = _run("clean", ftrun, base, work, state, limit_s)
    if clean["result"] is None:
        raise SystemExit(f"the fault-free run failed; see {clean['log']}")
    clean_hash = clean["result"]["params_xxh3"]
    launchers = [
        ("ftrun, collective detection", [*ftrun, "--on-hang", "restart"], [], state),
        ("ftrun, detection off (--on-hang warn)", [*ftrun, "--on-hang", "warn"], [], state),
        ("torchrun, --pg-timeout 15", torchrun, ["--pg-timeout", "15"], torch_env),
        ("torchrun, default timeout (1800 s)", torchrun, ["--pg-timeout", "1800"], torch_env),
    ]
    rows = []
    for fault in faults:
        for label, launcher, extra, env in launchers:
            row = measure_one(label, launcher, fault, [*base, *extra], fail_at, work, env,
                              limit_s, clean_hash)
            print(f"latency: {row}", flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def s(v: Any) -> str:
        return "–" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| fault | launcher | detected (s) | workers restarted (s) | next step (s) | "
             "ranks named | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['launcher']} | {s(r.get('detected_s'))} | "
                     f"{s(r.get('restarted_s'))} | {s(r.get('resumed_s'))} | "
                     f"{s(r.get('named'))} | {r.get('error') or r.get('note') or ''} |")
    return "\n".join(lines)
