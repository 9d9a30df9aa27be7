"""Detection benchmarks. Each part is one function; ``main()`` runs the parts asked for.

Part ``overhead``: a small DDP training (3 ranks, gloo, CPU) in blocks of steps with the
collective monitor (ftrun.rank.collectives) off and on, alternating in the same processes (so
process placement and drift of the machine cancel out). Reports the median step time of each,
the median of the pairs' ratios, and the monitor thread's CPU time per second of training.
The monitor reports to a real detect endpoint (a transport.Server on loopback).

    python bench/detect.py overhead [--pairs 8] [--steps 600] [--ranks 3]

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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ftrun.protocol.messages import Message  # noqa: E402
from ftrun.protocol.service import Service  # noqa: E402
from ftrun.protocol.transport import Server  # noqa: E402
from ftrun.testing import free_port  # noqa: E402

PARTS = ("overhead", "latency", "scale")
SECRET = "bench-detect"
JOB = "bench-detect"

# One rank: DDP over a small MLP, in blocks of steps with the collective monitor off and on
# (pairs of blocks, in alternating order, in the same processes); prints each block's step
# times and the monitor thread's CPU as JSON.
WORKER = r'''
import json, os, socket, statistics, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ftrun.rank.collectives import CollectiveMonitor

steps, dim, pairs, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cuda = device == "cuda"
backend = "nccl" if cuda else "gloo"
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, dim), torch.nn.ReLU(),
    torch.nn.Linear(dim, dim)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, dim, device=device)


def block(n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if cuda:  # the step ends when the GPU is done, as loss.item() would wait
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def thread_cpu_s(tid):
    with open(f"/proc/self/task/{tid}/schedstat") as f:  # ns, scheduler accounting
        return int(f.read().split()[0]) / 1e9


block(20)  # warm-up
blocks = []
for i in range(pairs):
    for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
        monitor = None
        if mode == "on":  # as ftrun.monitor_collectives() builds it
            monitor = CollectiveMonitor(
                os.environ["FTRUN_DETECT"], os.environ["FTRUN_SECRET"].encode(),
                os.environ["FTRUN_RUN_ID"], rank=dist.get_rank(),
                world_size=dist.get_world_size(), backend=backend, node_id="bench",
                host=socket.gethostname(), restart=0, interval_s=0.02)
            monitor.start()
        times = block(steps)
        out = {"pair": i, "mode": mode, "median_s": statistics.median(times),
               "seconds": sum(times)}
        if monitor is not None:
            out["cpu_s"] = thread_cpu_s(monitor._thread.native_id)
            out["dumps"] = monitor.counters["dumps"]
            out["reads"] = monitor.counters["samples"]
            monitor.stop()
        blocks.append(out)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "blocks": blocks}), flush=True)
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
        self._service = Service(Server("detect endpoint", SECRET.encode(), JOB,
                                       {"coll_report": self._on}, sender="bench"),
                                poll_s=0.05, max_messages=1000)
        self.address = self._service.bind_tcp("127.0.0.1")
        self._service.start()

    def _on(self, msg: Message) -> tuple[str, dict[str, Any]]:
        self.count += 1
        return "ack", {}

    def close(self) -> None:
        self._service.stop(5)


def _run(script: Path, ranks: int, steps: int, dim: int, pairs: int, detect: str,
         timeout_s: float, device: str = "cpu") -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    try:
        for rank in range(ranks):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "FTRUN_SECRET": SECRET, "FTRUN_RUN_ID": JOB, "FTRUN_DETECT": detect,
                   # as ftrun's launcher sets it for NCCL ranks: NCCL times every collective
                   "TORCH_NCCL_ENABLE_TIMING": "1"}
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(steps), str(dim), str(pairs), device],
                env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
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


def overhead(pairs: int = 8, steps: int = 600, ranks: int = 3, dim: int = 512,
             timeout_s: float = 900.0, device: str = "cpu") -> dict[str, Any]:
    """Step time with the monitor off and on, in ``pairs`` pairs of ``steps``-step blocks
    that alternate in the same processes (the order alternates from pair to pair)."""
    import tempfile

    endpoint = _Endpoint()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "worker.py"
            script.write_text(WORKER)
            res = _run(script, ranks, steps, dim, pairs, endpoint.address, timeout_s, device)
    finally:
        endpoint.close()

    def block_median(pair: int, mode: str) -> float:
        """A block's step time: the median over the ranks of their medians."""
        return statistics.median(b["median_s"] for r in res for b in r["blocks"]
                                 if b["pair"] == pair and b["mode"] == mode)

    off_med = [block_median(i, "off") for i in range(pairs)]
    on_med = [block_median(i, "on") for i in range(pairs)]
    ratios = [on / off for on, off in zip(on_med, off_med, strict=True)]
    on_blocks = [b for r in res for b in r["blocks"] if b["mode"] == "on"]
    result = {"pairs": pairs, "steps": steps, "ranks": ranks, "dim": dim, "device": device,
              "step_off_ms": statistics.median(off_med) * 1e3,
              "step_on_ms": statistics.median(on_med) * 1e3,
              "ratio": statistics.median(ratios),
              "monitor_cpu_ms_per_s": statistics.median(b["cpu_s"] / b["seconds"]
                                                        for b in on_blocks) * 1e3,
              "reads_per_s": statistics.median(b["reads"] / b["seconds"] for b in on_blocks),
              "reports": endpoint.count, "full_dumps": sum(b["dumps"] for b in on_blocks),
              "pair_ratios": ratios, "off_blocks_ms": [m * 1e3 for m in off_med],
              "on_blocks_ms": [m * 1e3 for m in on_med]}
    backend = "NCCL (CUDA)" if device == "cuda" else "gloo"
    print(f"monitor overhead: {ranks} ranks {backend} DDP, {pairs} pairs of {steps}-step blocks "
          "(monitor off, on) in the same processes")
    print(f"{'':24}{'median step':>14}")
    print(f"{'monitor off':24}{result['step_off_ms']:>11.3f} ms")
    print(f"{'monitor on':24}{result['step_on_ms']:>11.3f} ms")
    print(f"{'ratio on/off (pairs)':24}{result['ratio']:>14.4f}  "
          f"({(result['ratio'] - 1) * 100:+.2f}%, median of the pairs' ratios)")
    print(f"{'monitor thread CPU':24}{result['monitor_cpu_ms_per_s']:>11.3f} ms/s  "
          f"({result['reads_per_s']:.1f} reads/s)")
    print(f"{'reports received':24}{endpoint.count:>14}  (full dumps: {result['full_dumps']})")
    print("pair ratios:", " ".join(f"{r:.4f}" for r in ratios))
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
    p.add_argument("--pairs", type=int, default=8,
                   help="overhead: pairs of blocks, monitor off and on (default 8)")
    p.add_argument("--steps", type=int, default=600,
                   help="overhead: steps per block (default 600; long blocks: the monitor "
                   "reads finely for 2 s after a long collective)")
    p.add_argument("--ranks", type=int, default=3, help="overhead: ranks (default 3)")
    p.add_argument("--dim", type=int, default=512, help="overhead: MLP width (default 512)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="overhead: cpu (gloo, default) or cuda (NCCL, one rank per GPU)")
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
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                p.error("--device cuda: torch sees no GPU here")
            args.ranks = min(args.ranks, torch.cuda.device_count())
        r = overhead(args.pairs, args.steps, args.ranks, args.dim, device=args.device)
        results["overhead"] = r
        kind = "NCCL ranks on GPUs" if args.device == "cuda" else "gloo ranks"
        sections.append(
            f"**Monitor overhead** ({r['ranks']} {kind}, DDP MLP, {r['pairs']} pairs of "
            f"{r['steps']}-step blocks with the monitor off and on, in the same processes)\n\n"
            "| monitor off | monitor on | ratio (median of the pairs') | pairs' ratios | "
            "monitor thread CPU |\n|---|---|---|---|---|\n"
            f"| {r['step_off_ms']:.3f} ms | {r['step_on_ms']:.3f} ms | {r['ratio']:.4f} | "
            f"{min(r['pair_ratios']):.3f}-{max(r['pair_ratios']):.3f} | "
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
        if args.device == "cuda":
            import torch

            host = f"{torch.cuda.get_device_name(0)} (NCCL), torch {torch.__version__}"
        else:
            host = "CPU only (gloo)"
        cmd = " ".join(["python", "bench/detect.py", *(argv if argv is not None
                                                        else sys.argv[1:])])
        with open(args.output, "a") as f:
            f.write(f"\n## Detection (C4-style collective analysis)\n\n`{cmd}` on {date}, "
                    f"{os.cpu_count()} CPUs, {host}.\n\n" + "\n\n".join(sections)
                    + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
