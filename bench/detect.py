"""Detection benchmarks. Each part is one function; ``main()`` runs the parts asked for.

Part ``overhead``: the same small DDP training (3 ranks, gloo, CPU) with and without the
collective monitor (ftrun.rank.collectives), in interleaved runs. Reports the median step time
of each, their ratio, and the monitor thread's CPU time per second of training. The monitor
reports to a real detect endpoint (a transport.Server on loopback) that counts the reports.

    python bench/detect.py overhead [--runs 4] [--steps 300] [--ranks 3]

Part ``latency`` (bench/_detect_latency.py): from a hang (SIGSTOP, or a collective that never
returns) to resumed training, ftrun with and without collective detection against torchrun
with tuned and default process-group timeouts. Part ``scale`` (bench/_detect_scale.py): the
detection service under thousands of simulated ranks, and its detection latency there.

All parts in one run, appended to the results:

    python bench/detect.py --output bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _jobs import free_port  # noqa: E402

from ftrun.protocol.messages import Message  # noqa: E402
from ftrun.protocol.transport import Server  # noqa: E402

PARTS = ("overhead", "latency", "scale")
SECRET = "bench-detect"
JOB = "bench-detect"

# One rank: DDP over a small MLP; prints its step times and the monitor's CPU as JSON.
WORKER = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import ftrun

steps, dim = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, dim), torch.nn.ReLU(),
    torch.nn.Linear(dim, dim)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
monitor = ftrun.monitor_collectives()
x = torch.randn(64, dim)
times = []
for step in range(steps + 10):
    t0 = time.perf_counter()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    times.append(time.perf_counter() - t0)
times = times[10:]
out = {"rank": dist.get_rank(), "times": times, "monitor": monitor is not None}
if monitor is not None:
    import threading
    # The monitor thread's CPU time (ns, scheduler accounting) from /proc.
    tid = next(t.native_id for t in threading.enumerate() if t.name == "ftrun-collectives")
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        cpu_s = int(f.read().split()[0]) / 1e9
    counters = monitor.counters
    out.update(cpu_s=cpu_s, reports=counters["reports"], full_dumps=counters["dumps"])
print("RESULT " + json.dumps(out), flush=True)
del model, opt
# DDP must go before its group: dropping the last reference in the group's teardown
# can deadlock gloo's worker threads at exit.
import gc
gc.collect()
dist.destroy_process_group()
'''


class _Endpoint:
    def __init__(self) -> None:
        self.count = 0
        self.server = Server("detect endpoint", SECRET.encode(), JOB,
                             {"coll_report": self._on}, sender="bench")
        self.address = self.server.bind_tcp("127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _on(self, msg: Message) -> tuple[str, dict[str, Any]]:
        self.count += 1
        return "ack", {}

    def _loop(self) -> None:
        self.server.serve_until(self._stop, 0.05, max_messages=1000)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


def _run(script: Path, ranks: int, steps: int, dim: int, detect: str | None,
         timeout_s: float) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    try:
        for rank in range(ranks):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "FTRUN_SECRET": SECRET, "FTRUN_RUN_ID": JOB, "FTRUN_NODE_ID": "bench"}
            env.pop("FTRUN_DETECT", None)
            if detect:
                env["FTRUN_DETECT"] = detect
            procs.append(subprocess.Popen([sys.executable, str(script), str(steps), str(dim)],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"a rank failed (exit {proc.returncode}):\n{out[-2000:]}")
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            results.append(json.loads(line[len("RESULT "):]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def overhead(runs: int = 4, steps: int = 300, ranks: int = 3, dim: int = 512,
             timeout_s: float = 300.0) -> dict[str, Any]:
    """Step time with and without the collective monitor, ``runs`` interleaved pairs."""
    import tempfile

    endpoint = _Endpoint()
    off_med: list[float] = []
    on_med: list[float] = []
    cpu_per_s: list[float] = []
    full_dumps = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "worker.py"
            script.write_text(WORKER)
            for i in range(runs):
                order = (None, endpoint.address) if i % 2 == 0 else (endpoint.address, None)
                for detect in order:
                    res = _run(script, ranks, steps, dim, detect, timeout_s)
                    med = statistics.median(t for r in res for t in r["times"])
                    (on_med if detect else off_med).append(med)
                    if detect:
                        for r in res:
                            cpu_per_s.append(r["cpu_s"] / sum(r["times"]))
                            full_dumps += r["full_dumps"]
    finally:
        endpoint.close()
    off, on = statistics.median(off_med), statistics.median(on_med)
    result = {"runs": runs, "steps": steps, "ranks": ranks, "dim": dim,
              "step_off_ms": off * 1e3, "step_on_ms": on * 1e3, "ratio": on / off,
              "monitor_cpu_ms_per_s": statistics.median(cpu_per_s) * 1e3,
              "reports": endpoint.count, "full_dumps": full_dumps,
              "off_runs_ms": [m * 1e3 for m in off_med], "on_runs_ms": [m * 1e3 for m in on_med]}
    print(f"monitor overhead: {ranks} ranks gloo DDP, {steps} steps x {runs} interleaved pairs")
    print(f"{'':24}{'median step':>14}")
    print(f"{'monitor off':24}{result['step_off_ms']:>11.3f} ms")
    print(f"{'monitor on':24}{result['step_on_ms']:>11.3f} ms")
    print(f"{'ratio on/off':24}{result['ratio']:>14.4f}  ({(result['ratio'] - 1) * 100:+.2f}%)")
    print(f"{'monitor thread CPU':24}{result['monitor_cpu_ms_per_s']:>11.3f} ms/s")
    print(f"{'reports received':24}{endpoint.count:>14}  (full dumps: {full_dumps})")
    print("per run off:", " ".join(f"{m:.3f}" for m in result["off_runs_ms"]),
          " on:", " ".join(f"{m:.3f}" for m in result["on_runs_ms"]))
    return result


def main(argv: list[str] | None = None) -> int:
    import tempfile
    from datetime import datetime, timezone

    import _detect_latency
    import _detect_scale

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", metavar="PART",
                   help=f"which parts to run: {', '.join(PARTS)} (default: all, in one run)")
    p.add_argument("--runs", type=int, default=4, help="overhead: interleaved off/on pairs")
    p.add_argument("--steps", type=int, default=300, help="overhead: timed steps per run")
    p.add_argument("--ranks", type=int, default=3, help="overhead: ranks (default 3)")
    p.add_argument("--dim", type=int, default=512, help="overhead: MLP width (default 512)")
    p.add_argument("--scale-ranks", type=int, default=4096,
                   help="scale: simulated ranks (default 4096)")
    p.add_argument("--scale-seconds", type=float, default=40.0,
                   help="scale: seconds of simulated reports (default 40)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON here")
    p.add_argument("--output", metavar="FILE", help="append the tables to this Markdown file")
    args = p.parse_args(argv)
    parts = args.parts or list(PARTS)
    for part in parts:
        if part not in PARTS:
            p.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    results: dict[str, Any] = {}
    sections: list[str] = []
    if "overhead" in parts:
        r = overhead(args.runs, args.steps, args.ranks, args.dim)
        results["overhead"] = r
        sections.append(
            "**Monitor overhead** (3 gloo ranks, DDP MLP, interleaved off/on runs)\n\n"
            "| monitor off | monitor on | ratio | monitor thread CPU |\n|---|---|---|---|\n"
            f"| {r['step_off_ms']:.3f} ms | {r['step_on_ms']:.3f} ms | {r['ratio']:.4f} | "
            f"{r['monitor_cpu_ms_per_s']:.1f} ms per s |")
    if "latency" in parts:
        with tempfile.TemporaryDirectory(prefix="ftrun-bench-detect-") as tmp:
            rows = _detect_latency.latency(Path(tmp))
        results["latency"] = rows
        table = _detect_latency.table(rows)
        print(table)
        sections.append("**Hang to resumed training** (1 node x 3 ranks, gloo, rank 1 hangs "
                        "in step 10; seconds from the fault)\n\n" + table)
    if "scale" in parts:
        r = _detect_scale.scale(ranks=args.scale_ranks, duration_s=args.scale_seconds,
                                stall_after_s=args.scale_seconds / 2)
        results["scale"] = r
        table = _detect_scale.table(r)
        print(table)
        sections.append("**Detection service at scale** (simulated ranks reporting every "
                        "0.5 s, one freezes halfway)\n\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.output:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = " ".join(["python", "bench/detect.py", *(argv if argv is not None
                                                        else sys.argv[1:])])
        with open(args.output, "a") as f:
            f.write(f"\n## Detection (C4-style collective analysis)\n\n`{cmd}` on {date}, "
                    f"{os.cpu_count()} CPUs, CPU only (gloo).\n\n" + "\n\n".join(sections)
                    + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
