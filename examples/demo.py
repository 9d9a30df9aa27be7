"""The quick-start demo: one machine plays two nodes of two ranks each.

It trains ``examples/train.py`` twice under ftrun: once clean, once with rank 1 killed
(SIGKILL) at step 5. ftrun restarts the workers and the job finishes; both runs must end
with the same ``params_xxh3``. Exit code 0 when they do.

The demo's state directory (job files, event logs) and the faulted run's persisted snapshot
stay on disk afterwards; the demo ends with commands (:func:`hints`) that look at them, all
of which work once the jobs have ended.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Hint:
    """A command the demo suggests running after it exits, and what it shows."""

    what: str
    argv: list[str]

    def line(self) -> str:
        return shlex.join(self.argv)


def ftrun_command() -> list[str]:
    """ftrun as it can be run from any directory: this interpreter's script, else ``-m``."""
    script = Path(sys.executable).with_name("ftrun")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ftrun"]


def hints(state_dir: Path, run_id: str, persist_dir: Path) -> list[Hint]:
    """What to look at once the demo (whose faulted run is ``run_id``) has exited.

    Each command works on ended jobs: the job list of the state directory, the persisted
    snapshot (a live job's ``ftrun status RUN_ID`` needs its coordinator, gone by then), the
    job's event log, and removing it all.
    """
    ftrun = ftrun_command()
    events = state_dir / "jobs" / run_id / "events.jsonl"
    return [
        Hint("the demo's jobs (both have ended)", [*ftrun, "status", "--state-dir", str(state_dir)]),
        Hint("the faulted run's last snapshot, persisted in torch.distributed.checkpoint format,"
             " re-hashed", [*ftrun, "inspect", str(persist_dir), "--verify"]),
        Hint("how the faulted run recovered, from its event log",
             ["grep", "-E", '"type":"(worker_failure|restart|restore|job_end)"', str(events)]),
        Hint("remove the demo's files", ["rm", "-rf", str(state_dir)]),
    ]


def format_hints(state_dir: Path, items: list[Hint]) -> str:
    lines = [f"\nThe demo's files stay in {state_dir}. To look at them:"]
    for hint in items:
        lines += [f"   # {hint.what}", f"   {hint.line()}"]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(label: str, run_id: str, train_args: list[str], state_dir: Path,
            timeout_s: float, ftrun_args: tuple[str, ...] = ()) -> str:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ftrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "2",
        *ftrun_args,
        str(ROOT / "examples" / "train.py"),
        *train_args,
    ]
    env = {**os.environ, "FTRUN_STATE_DIR": str(state_dir)}
    print(f"\n== {label}: two ftrun launchers (nodes), two ranks each, run id {run_id}", flush=True)
    print("   each launcher runs: " + shlex.join(cmd[2:]), flush=True)
    nodes = [
        subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    result = ""
    try:
        for i, node in enumerate(nodes):
            out, _ = node.communicate(timeout=timeout_s)
            for line in out.splitlines():
                if (
                    line.startswith("ftrun-example")
                    or "ftrun" in line
                    and ("ERROR" in line or "restart" in line.lower() or "injecting" in line)
                ):
                    print(f"   node{i}| {line}", flush=True)
                if line.startswith("ftrun-example: step="):
                    result = line.split("params_xxh3=")[1].strip()
            if node.returncode != 0:
                raise SystemExit(f"{label}: node {i} exited with {node.returncode}")
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    print(f"   {label}: params_xxh3={result}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    args = p.parse_args()
    # Kept after the demo: the commands it suggests at the end look at what is in here.
    state_dir = Path(tempfile.mkdtemp(prefix="ftrun-demo-"))
    persist_dir = state_dir / "ckpt-faulted"
    faulted_id = f"demo-faulted-{uuid.uuid4().hex[:6]}"
    steps = ["--steps", str(args.steps)]
    try:
        clean = run_job("clean", f"demo-clean-{uuid.uuid4().hex[:6]}", steps, state_dir,
                        args.timeout)
        faulted = run_job(
            "faulted",
            faulted_id,
            [*steps, "--fail-at-step", "5", "--fail-rank", "1", "--fail-mode", "kill"],
            state_dir,
            args.timeout,
            ftrun_args=("--persist-dir", str(persist_dir)),
        )
    except SystemExit:
        print(f"The demo's files (job files, event logs) stay in {state_dir}; remove them "
              f"with: {shlex.join(['rm', '-rf', str(state_dir)])}", flush=True)
        raise
    same = clean == faulted and clean != ""
    print(
        f"\nfault-free {clean} vs with a killed rank {faulted}: "
        f"{'IDENTICAL' if same else 'DIFFERENT'}"
    )
    print(format_hints(state_dir, hints(state_dir, faulted_id, persist_dir)), flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
