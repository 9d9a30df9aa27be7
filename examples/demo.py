"""The quick-start demo: one machine plays two nodes of two ranks each.

It trains ``examples/train.py`` twice under ftrun: once clean, once with rank 1 killed
(SIGKILL) at step 5. ftrun restarts the workers and the job finishes; both runs must end
with the same ``params_xxh3``. Exit code 0 when they do.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(label: str, train_args: list[str], state_dir: str, timeout_s: float) -> str:
    run_id = f"demo-{label}-{uuid.uuid4().hex[:6]}"
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
        str(ROOT / "examples" / "train.py"),
        *train_args,
    ]
    env = {**os.environ, "FTRUN_STATE_DIR": state_dir}
    print(f"\n== {label}: two ftrun launchers (nodes), two ranks each, run id {run_id}", flush=True)
    print("   $ " + " ".join(cmd[2:]), flush=True)
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
    print(f"   {label}: params_xxh3={result}  (status: ftrun status {run_id})", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftrun-demo-") as state_dir:
        steps = ["--steps", str(args.steps)]
        clean = run_job("clean", steps, state_dir, args.timeout)
        faulted = run_job(
            "faulted",
            [*steps, "--fail-at-step", "5", "--fail-rank", "1", "--fail-mode", "kill"],
            state_dir,
            args.timeout,
        )
    same = clean == faulted and clean != ""
    print(
        f"\nfault-free {clean} vs with a killed rank {faulted}: "
        f"{'IDENTICAL' if same else 'DIFFERENT'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
