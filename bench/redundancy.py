"""Snapshot redundancy side by side: full replicas against erasure coding, in one run.

    .venv/bin/python bench/redundancy.py [--nodes 4] [--codes replicas:1,replicas:2,ec:2+1,ec:3+1,ec:2+2]
        [--dim 384 --layers 4] [--repeats 1] [--output FILE]

``--nodes`` launchers of one rank each on this machine, each with shared memory of its own
(``FTRUN_SHM_DIR``: one host's memory, gone with it), train ``examples/train.py`` with a
snapshot every step (``--snapshot-every auto``: ftrun's cadence) under each
``--redundancy`` in turn (``replicas:1``: none, the
baseline), ``--nnodes N-1:N``, with no ``--persist-dir`` (the stores' socket writes are then
all network). Per code:

- **host memory** per node: the shared memory each host's store holds (``st_blocks`` of
  every segment: rank buffers, replicas, parity fragments) at the end of the timed steps,
  median over the hosts, and as a multiple of one rank's snapshot;
- **network per snapshot**: bytes sent on loopback (``/proc/net/dev``, ``lo``) per step, less
  the same job's without redundancy (``replicas:1``: the gradients' all-reduce and the
  control messages): replicas sent, data slices pulled for parity;
- **store CPU** seconds per step (all hosts), and the ranks';
- **throughput**: steps/s over the timed steps, against ``replicas:1`` in the same run;
- **node loss** (not for ``replicas:1``, which has no copy to restore from): once the timed
  steps are done, one launcher (not the one hosting the rendezvous store) is SIGKILLed with
  its processes and its memory removed; the time to the next step completed, the step
  resumed from and where from (memory: a replica or a rebuilt shard).

The codes alternate order over ``--repeats``. Prints a markdown section; ``--output`` writes
it to a file too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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
sys.path.insert(0, str(ROOT / "bench"))

import replicate as rep  # noqa: E402  (bench/replicate.py: hosts, samplers, status)

from ftrun.testing import free_port, git_tree, read_jsonl, tree_pids  # noqa: E402

TRAIN = ROOT / "examples" / "train.py"
RESUMED = re.compile(r"rank (\d+) resumed from step (\d+) \(.*?\), from (\w+)")
TAIL_STEPS = 15  # steps after the timed ones, during which the node is lost


def loopback_tx() -> int:
    """Bytes sent on this network namespace's loopback so far (``/proc/net/dev``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def shm_held(path: Path) -> int:
    """Bytes of memory the segments under ``path`` occupy."""
    total = 0
    with contextlib.suppress(OSError):
        for p in path.iterdir():
            with contextlib.suppress(OSError):
                total += p.stat().st_blocks * 512
    return total


def run_code(code: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    n = args.nodes
    run_id = f"benchred-{code.replace(':', '').replace('+', 'p')}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    steplog = work / f"{run_id}.steps"
    total = args.warmup + args.steps + TAIL_STEPS
    cmd = [*rep.ftrun_cmd(f"{n - 1}:{n}", port, run_id, [
        "--redundancy", code, "--replica-addr", "127.0.0.1", "--max-restarts", "3",
        "--rdzv-conf", rep.RDZV_CONF]),
        str(TRAIN), *rep.model_args(args), "--steps", str(total),
        "--snapshot-every", args.snapshot_every,
        "--step-log", str(steplog)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FTRUN_STATE_DIR": str(work / "state")}
    job = rep.Hosts(cmd, n, env, work, run_id)
    out: dict[str, Any] = {"code": code}
    try:
        sampler = rep.CpuSampler(job.pids)
        rep.wait_steps(steplog, lambda s: len(s) >= args.warmup, job, args.job_timeout,
                       f"{code}: step {args.warmup}")
        sampler.sample()
        cpu0, w0 = sampler.by_kind(), loopback_tx()
        rep.wait_steps(steplog, lambda s: len(s) >= args.warmup + args.steps, job,
                       args.job_timeout, f"{code}: step {args.warmup + args.steps}", sampler)
        sampler.sample()
        cpu1, w1 = sampler.by_kind(), loopback_tx()
        held = [shm_held(p) for p in job.shm]
        status = rep.job_status(run_id, work)
        steps = read_jsonl(steplog)
        timed = [s for s in steps if args.warmup < s["step"] <= args.warmup + args.steps]
        span = timed[-1]["time"] - next(s for s in steps if s["step"] == args.warmup)["time"]
        out.update(steps_s=len(timed) / span, cpu={k: (cpu1[k] - cpu0[k]) / len(timed)
                                                   for k in cpu1},
                   net_per_step=(w1 - w0) / len(timed), held=held,
                   status=status)
        if code == "replicas:1":  # nothing to restore a lost node from
            codes = job.wait(args.job_timeout)
            out.update(loss_to_step_s=None, resumed_from=None, last_done=None, sources=[],
                       rebuilt=False, codes=codes)
            return out
        # The node loss: a launcher that does not host the rendezvous store.
        host = rep.listening_pid(port, [p for root in job.pids for p in tree_pids(root)])
        victim = next(i for i, root in enumerate(job.pids) if host not in tree_pids(root))
        before = read_jsonl(steplog)
        killed_at = job.lose(victim)
        restart0 = max(s["restart"] for s in before)
        last_done = max(s["step"] for s in before if s["time"] <= killed_at)
        rep.wait_steps(steplog, lambda s: any(x["time"] > killed_at and (
            x["restart"] > restart0 or x["step"] <= last_done) for x in s), job,
            args.job_timeout, f"{code}: a step after the node loss")
        first = next(s for s in read_jsonl(steplog) if s["time"] > killed_at
                     and (s["restart"] > restart0 or s["step"] <= last_done))
        survivors = [p for i, p in enumerate(job.procs) if i != victim]
        deadline = time.monotonic() + args.job_timeout
        for p in survivors:
            with contextlib.suppress(Exception):
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        logs = job.tail()
        sources = sorted({src for _, _, src in RESUMED.findall(logs)})
        out.update(loss_to_step_s=first["time"] - killed_at, resumed_from=first["step"] - 1,
                   last_done=last_done, sources=sources,
                   rebuilt="erasure coding: rebuilt rank" in logs,
                   codes=[p.poll() for p in survivors])
    finally:
        out["left"] = job.kill()
    return out


def table(runs: dict[str, list[dict[str, Any]]], mb: float) -> str:
    med = statistics.median
    base = med([r["steps_s"] for r in runs["replicas:1"]]) if "replicas:1" in runs else None
    net0 = (med([r["net_per_step"] for r in runs["replicas:1"]])
            if "replicas:1" in runs else 0.0)
    lines = ["| code | host memory per node (MB, x a rank's snapshot) | network per step for "
             "redundancy, all nodes (MB) | store CPU s per step | rank CPU s per step | steps/s | vs "
             "replicas:1 | node loss -> next step (s) | resumed from / last done, from |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for code, rs in runs.items():
        held = med([med(r["held"]) for r in rs]) / 1e6
        sps = med([r["steps_s"] for r in rs])
        ratio = f"{sps / base:.3f}" if base else "—"
        where = "; ".join(f"{r['resumed_from']} / {r['last_done']}, "
                          f"{'+'.join(r['sources']) or '?'}"
                          f"{' (rebuilt)' if r['rebuilt'] else ''}" for r in rs
                          if r["loss_to_step_s"] is not None) or "— (no copy)"
        losses = [r["loss_to_step_s"] for r in rs if r["loss_to_step_s"] is not None]
        loss = f"{med(losses):.2f}" if losses else "—"
        lines.append(
            f"| {code} | {held:.0f} ({held / mb:.2f}x) | "
            f"{(med([r['net_per_step'] for r in rs]) - net0) / 1e6:.1f} | "
            f"{med([r['cpu']['store'] for r in rs]):.3f} | "
            f"{med([r['cpu']['rank'] for r in rs]):.3f} | {sps:.3f} | {ratio} | "
            f"{loss} | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--codes", default="replicas:1,replicas:2,ec:2+1,ec:3+1,ec:2+2")
    p.add_argument("--dim", type=int, default=384, help="train.py --dim")
    p.add_argument("--layers", type=int, default=4, help="train.py --layers")
    p.add_argument("--warmup", type=int, default=8, help="steps not timed")
    p.add_argument("--steps", type=int, default=20, help="steps timed")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--snapshot-every", default="1",
                   help="train.py --snapshot-every: 1 (every step) or auto (ftrun's cadence)")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--output", type=Path, help="also write the section to this file")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    codes = [c.strip() for c in args.codes.split(",") if c.strip()]
    started = datetime.now(timezone.utc)
    loads = [rep.load()]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in codes}
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-redundancy-") as tmp:
        for r in range(args.repeats):
            for code in codes if r % 2 == 0 else codes[::-1]:
                res = run_code(code, args, Path(tmp))
                runs[code].append(res)
                print(f"  {code}: {json.dumps(res, default=str)}", flush=True)
                loads.append(rep.load())
    mb = rep.snapshot_mb(args)
    cmd = " ".join(["python bench/redundancy.py", *(argv if argv is not None else sys.argv[1:])])
    text = (f"`{cmd}` on {started:%Y-%m-%d %H:%M} UTC, code {git_tree()}; {rep.hardware()}; "
            f"load average after each run: {', '.join(loads)}.\n\n"
            f"{args.nodes} launchers of 1 rank each, each with shared memory of its own, "
            f"`--nnodes {args.nodes - 1}:{args.nodes}`, examples/train.py --dim {args.dim} "
            f"--layers {args.layers} (a snapshot of {mb:.0f} MB per rank: params and AdamW's "
            f"moments), `--snapshot-every {args.snapshot_every}`, no `--persist-dir`; steps "
            f"{args.warmup + 1}..{args.warmup + args.steps} timed; then one "
            "launcher (not the rendezvous store's) killed with its memory.\n\n"
            + table(runs, mb))
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
