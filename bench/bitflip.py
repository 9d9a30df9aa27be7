"""Benchmark: silent data corruption, from the flipped bit to training again in a good state.

One command::

    .venv/bin/python bench/bitflip.py [--repeats 2] [--at-step 40] [--output FILE]

The job is ``examples/user_ddp.py`` (``@ftrun.resilient``, ``Snapshotter``; gloo on CPU) on one
launcher x 3 ranks. A fault-free run gives the reference weights; then each repeat flips one
mantissa bit of one parameter of rank 1 after its optimizer step in step ``--at-step``
(``--fail-mode bitflip``: the rank trains on, its replica now differs). ftrun's coordinator
names the rank whose snapshot hashes disagree with the others' at the next snapshot every rank
took, and the job restarts in place from the last agreed step.

Per repeat: the step the corruption was named in, the time from the flip (the fault marker the
script writes just before it) to the end of the in-place restart (its ``recovery`` event), and
to the first step every rank logged after that restart ("flip -> next step"); which ranks kept
their processes; whether the final weights equal the fault-free run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from replicate import hardware, load  # noqa: E402

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
DIGEST = re.compile(r"user-ddp: step=\d+ world=\d+ params_xxh3=([0-9a-f]+)")
NAMED = re.compile(r"silent data corruption in step (\d+)")


def run(work: Path, args: argparse.Namespace, flip_at: int) -> dict:
    """One job; ``flip_at`` 0: fault-free."""
    d = work / (f"flip{flip_at}-" + uuid.uuid4().hex[:6])
    d.mkdir()
    run_id = f"benchflip-{d.name}"
    cmd = [sys.executable, "-m", "ftrun", "--standalone", "--rdzv-id", run_id,
           "--nproc-per-node", "3", "--max-restarts", "2", SCRIPT, "--epochs", "2",
           "--samples", str(args.samples), "--batch-size", "8", "--hidden", "64",
           "--fault-dir", str(d), "--pid-log", str(d)]
    if flip_at:
        cmd += ["--fail-mode", "bitflip", "--kill-at-step", str(flip_at), "--kill-rank", "1"]
    env = {**os.environ, "FTRUN_STATE_DIR": str(d / "state")}
    with open(d / "out.log", "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=args.job_timeout, start_new_session=True).returncode
    text = (d / "out.log").read_text()
    digest = DIGEST.findall(text)
    doc: dict = {"code": code, "digest": digest[-1] if digest else None}
    if not flip_at:
        return doc
    markers = list(d.glob("user-ddp-fault-rank1-*"))
    events = [json.loads(line) for line in
              (d / "state" / "jobs" / run_id / "events.jsonl").read_text().splitlines()]
    recoveries = [e for e in events if e["type"] == "recovery"]
    if not markers or not recoveries:
        return {**doc, "fired": bool(markers), "recovered": False}
    flip = float(markers[0].read_text().split()[0])
    rec = recoveries[0]
    firsts = []
    for rank in range(3):
        rows = [line.split() for line in (d / f"pids-rank{rank}.log").read_text().splitlines()]
        firsts.append(min(float(t) for _, _, t in rows if float(t) > rec["ts"]))
    named = NAMED.findall(rec.get("why", ""))
    return {**doc, "fired": True, "recovered": True, "named_step": int(named[0]) if named else None,
            "to_recovery_s": rec["ts"] - flip, "to_next_step_s": max(firsts) - flip,
            "kept": rec.get("kept"), "new": rec.get("new_processes"), "why": rec.get("why")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--at-step", type=int, default=40, help="the step whose update is flipped")
    p.add_argument("--samples", type=int, default=1536, help="1536/3/8: 64 steps per epoch")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--output", type=Path, help="also write the section to this file")
    args = p.parse_args(argv)
    started = datetime.now(timezone.utc)
    load0 = load()
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-flip-") as tmp:
        work = Path(tmp)
        ref = run(work, args, 0)
        runs = [run(work, args, args.at_step) for _ in range(args.repeats)]
    rows = ["| run | named in step | flip -> recovery done | flip -> next step (every rank) | "
            "kept | new processes | final = fault-free |", "|---|---:|---:|---:|---|---|---|"]
    for i, r in enumerate(runs, 1):
        if not r.get("recovered"):
            rows.append(f"| {i} | — | — | — | — | — | fired: {r.get('fired')}, exit {r['code']} |")
            continue
        rows.append(f"| {i} | {r['named_step']} | {r['to_recovery_s']:.2f} s | "
                    f"{r['to_next_step_s']:.2f} s | {r['kept']} | {r['new']} | "
                    f"{'yes' if r['digest'] == ref['digest'] else 'NO'} |")
    done = [r["to_next_step_s"] for r in runs if r.get("recovered")]
    cmd = " ".join(["python bench/bitflip.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([
        "### A flipped bit: flip -> next step, every rank kept", "",
        f"- Command: `{cmd}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M}; {hardware()}; load average {load0} at start, "
        f"{load()} at end",
        f"- Job: `examples/user_ddp.py --epochs 2 --samples {args.samples} --batch-size 8 "
        f"--hidden 64`, 1 launcher x 3 ranks (gloo); rank 1's parameter bit flipped after its "
        f"optimizer step in step {args.at_step}. Fault-free: exit {ref['code']}, params_xxh3 "
        f"{ref['digest']}.", "", *rows, "",
        f"Median flip -> next step: {statistics.median(done):.2f} s." if done else
        "No repeat recovered.", ""])
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n")
    ok = bool(done) and all(r.get("digest") == ref["digest"] for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
