"""Benchmark: re-forming the process group inside a running worker vs starting a new one.

What an in-process restart saves. For each round, a worker that has a live process group
(NCCL on a GPU, gloo on the CPU) with a collective still in flight:

- **in place**: abort every process group (``ftrun._torch.abort_process_groups``), form a new
  default group under a fresh store prefix, and complete its first all-reduce;
- **new process**: what a restart by a launcher costs instead: a new interpreter, ``import
  torch``, the CUDA context (on a GPU), ``init_process_group`` and the first all-reduce,
  timed from ``Popen`` to the worker's report.

On a GPU the in-flight collective is queued behind a long kernel (``torch.cuda._sleep``), so
the abort meets work the device has not finished. One GPU holds one NCCL rank (NCCL refuses
two ranks on one device), so the NCCL rows are world size 1: the communicator's creation and
abort, not its network. On the CPU ``--ranks`` gloo ranks (default 3) re-form together.

    python bench/reform.py [--rounds 5] [--ranks 3] [--device cuda|cpu] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.testing import free_port  # noqa: E402

COLD = r"""
import os, sys, time
t0 = time.monotonic()
import torch, torch.distributed as dist
t_import = time.monotonic()
dev = torch.device("cuda", 0) if sys.argv[1] == "cuda" else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)  # the CUDA context
t_ctx = time.monotonic()
dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
t = torch.ones(1 << 20, device=dev)
dist.all_reduce(t)
if dev.type == "cuda":
    torch.cuda.synchronize()
t_done = time.monotonic()
print("COLD " + " ".join(f"{x:.6f}" for x in (t_import - t0, t_ctx - t_import, t_done - t_ctx)),
      flush=True)
dist.destroy_process_group()
"""


def _in_place_rank(rank: int, world: int, port: int, rounds: int, device: str,
                   out: str) -> None:
    import torch
    import torch.distributed as dist

    from ftrun import _torch

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__(
        "datetime").timedelta(seconds=60))
    dist.init_process_group(backend, store=dist.PrefixStore("world0", store), rank=rank,
                            world_size=world)
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)
    rows = []
    for n in range(1, 2 * rounds + 1):
        # Odd rounds abort with a collective in flight, even ones an idle group.
        busy = n % 2 == 1
        work = None
        if busy:
            if dev.type == "cuda":
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the all-reduce waits
            work = dist.all_reduce(t, async_op=True)
        elif dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.monotonic()
        _torch.abort_process_groups()
        t_abort = time.monotonic()
        del work
        dist.init_process_group(backend, store=dist.PrefixStore(f"world{n}", store), rank=rank,
                                world_size=world)
        t_init = time.monotonic()
        t = torch.ones(1 << 20, device=dev)
        dist.all_reduce(t)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert t[0].item() == world, t[0].item()
        t_done = time.monotonic()
        rows.append({"busy": busy, "abort_s": t_abort - t0, "init_s": t_init - t_abort,
                     "first_s": t_done - t_init, "total_s": t_done - t0})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def in_place(world: int, rounds: int, device: str, tmp: Path) -> list[dict[str, float]]:
    """Rank 0's phases of each in-place round (every rank runs the same rounds)."""
    import torch.multiprocessing as mp

    out = tmp / "in_place.json"
    mp.start_processes(_in_place_rank, args=(world, free_port(), rounds, device, str(out)),
                       nprocs=world, start_method="spawn", join=True)
    rows: list[dict[str, float]] = json.loads(out.read_text())
    return rows


def _abort_idle_s(rows: list[dict[str, float]]) -> float:
    return statistics.median(r["abort_s"] for r in rows if not r["busy"])


def cold(world: int, rounds: int, device: str) -> list[dict[str, float]]:
    """Rank 0's start of each round of ``world`` new worker processes, from ``Popen``."""
    rows = []
    for _ in range(rounds):
        port = free_port()
        procs = []
        t0 = time.monotonic()
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, "-c", COLD, device], env=env,
                                          stdout=subprocess.PIPE, text=True))
        try:
            line = procs[0].stdout.readline()  # type: ignore[union-attr]
            t_done = time.monotonic()
            for proc in procs:
                proc.communicate(timeout=120)
                if proc.returncode != 0:
                    raise RuntimeError(f"a cold worker failed (exit {proc.returncode})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        imp, ctx, pg = map(float, line.split()[1:])
        total = t_done - t0
        rows.append({"interpreter_s": total - imp - ctx - pg, "import_s": imp, "context_s": ctx,
                     "init_first_s": pg, "total_s": total})
    return rows


def _med(rows: list[dict[str, float]], key: str) -> float:
    """The median of ``key`` over the rounds that aborted with a collective in flight (all
    rounds of the new-process path)."""
    return statistics.median(r[key] for r in rows if r.get("busy", True))


def report(device: str, world: int, rounds: int, hot: list[dict[str, float]],
           fresh: list[dict[str, float]], gpu: str) -> str:
    backend = "NCCL" if device == "cuda" else "gloo"
    ratio = _med(hot, "total_s") / _med(fresh, "total_s")
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    lines = [
        f"### Group re-formation in place vs a new worker ({backend}, world size {world})",
        "",
        f"Command: `python bench/reform.py --device {device} --ranks {world} --rounds "
        f"{rounds}`; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {gpu}; torch "
        f"{__import__('torch').__version__}. Medians of {rounds} rounds of each (the in-place "
        "rounds alternate between a collective in flight and an idle group), rank 0's clock.",
        "",
        "| path | phase | median |",
        "| --- | --- | --- |",
        f"| in place | abort every group (a collective in flight) | {ms(_med(hot, 'abort_s'))} |",
        f"| in place | abort every group (idle: nothing in flight) | {ms(_abort_idle_s(hot))} |",
        f"| in place | init_process_group, new store prefix | {ms(_med(hot, 'init_s'))} |",
        f"| in place | first all-reduce (4 MB) | {ms(_med(hot, 'first_s'))} |",
        f"| in place | **total** | **{ms(_med(hot, 'total_s'))}** |",
        f"| new process | interpreter start | {ms(_med(fresh, 'interpreter_s'))} |",
        f"| new process | import torch | {ms(_med(fresh, 'import_s'))} |",
        f"| new process | CUDA context | {ms(_med(fresh, 'context_s'))} |",
        f"| new process | init_process_group + first all-reduce | "
        f"{ms(_med(fresh, 'init_first_s'))} |",
        f"| new process | **total** | **{ms(_med(fresh, 'total_s'))}** |",
        "",
        f"In place / new process: **{ratio:.3f}×** (the model, its restore and the data "
        "loader come on top of both paths; a new process also rebuilds whatever the script "
        "sets up before training: compiled code, loader workers).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--ranks", type=int, default=3, help="gloo ranks on the CPU (default 3); "
                   "NCCL uses one rank per GPU")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each path (default 5)")
    p.add_argument("--output", type=Path, help="append the table to this Markdown file")
    cfg = p.parse_args(argv)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here; pass --device cpu")
    world = torch.cuda.device_count() if device == "cuda" else cfg.ranks
    if device == "cuda" and world > 1:
        world = 1  # the cold worker script puts every rank on device 0
    if cfg.rounds < 1 or world < 1:
        raise SystemExit("--rounds and --ranks must be >= 1")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else f"{os.cpu_count()} CPUs"
    with tempfile.TemporaryDirectory(prefix="ftbench-reform-") as tmp:
        hot = in_place(world, cfg.rounds, device, Path(tmp))
    fresh = cold(world, cfg.rounds, device)
    text = report(device, world, cfg.rounds, hot, fresh, gpu)
    print(text)
    if cfg.output:
        with open(cfg.output, "a") as f:
            f.write("\n" + text)
        print(f"appended to {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
