"""Benchmark: worker start to the first line of user code, warm interpreter vs cold start.

    .venv/bin/python bench/warm.py [--repeats 5]

Each start goes through torch's own worker start (``get_subprocess_handler``, as the elastic
agent's process context and ftrun's ``replace_worker`` call it) with ftrun's worker shim in
the command, exactly as a launcher runs a rank: cold, or with a :class:`WarmPool` hooked in
(``ftrun._torch.intercept_worker_starts``) whose interpreter has finished importing torch,
as one has by the time a rank fails. The script records ``time.time()`` at its first line
and again right after ``import torch`` (what a training script does first); both are
reported from the moment the launcher asks for the process. Starts alternate warm and cold;
medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from ftrun.launcher.warm import WarmPool

SCRIPT = """\
import time
first = time.time()
import os, sys
import torch
after = time.time()
open(sys.argv[1], "w").write(f"{first} {after}")
"""


def one_start(script: Path, out: Path, pool: WarmPool | None) -> tuple[float, float, bool]:
    args = ("-m", "ftrun._exec", sys.executable, "-u", str(script), str(out))
    idle = set(pool.idle_pids()) if pool is not None else set()
    t0 = time.time()
    handler = get_subprocess_handler(sys.executable, args, {"RANK": "0"}, "", "", 0)
    if handler.proc.wait(120) != 0:
        raise SystemExit(f"the benchmark script failed (exit code {handler.proc.returncode})")
    first, after = map(float, out.read_text().split())
    return first - t0, after - t0, handler.proc.pid in idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    os.environ["FTRUN_LAUNCHER_PID"] = str(os.getpid())
    rows: dict[str, list[tuple[float, float]]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-warm-") as tmp:
        script, out = Path(tmp) / "first_line.py", Path(tmp) / "times"
        script.write_text(SCRIPT)
        pool = WarmPool.for_workers(sys.executable, ("-m", "ftrun._exec", sys.executable,
                                                     "-u", str(script)), dict(os.environ), 1)
        assert pool is not None
        for _ in range(opts.repeats):
            pool.start()
            if not pool.wait_ready(120):
                raise SystemExit("the warm interpreter did not import torch within 120 s")
            first, after, warm = one_start(script, out, pool)
            if not warm:
                raise SystemExit("the warm start did not run in the pre-started interpreter")
            rows["warm"].append((first, after))
            pool.close()  # the cold start goes torch's way
            first, after, _ = one_start(script, out, None)
            rows["cold"].append((first, after))
            pool = WarmPool.for_workers(sys.executable, ("-m", "ftrun._exec", sys.executable,
                                                         "-u", str(script)),
                                        dict(os.environ), 1)
            assert pool is not None
    import torch

    print(f"{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{opts.repeats} starts each, medians (min-max), seconds from the launcher's request")
    print("| start | to the script's first line | to after `import torch` |")
    print("|---|---|---|")
    for kind, values in rows.items():
        firsts, afters = [v[0] for v in values], [v[1] for v in values]
        print(f"| {kind} | {statistics.median(firsts):.3f} ({min(firsts):.3f}-{max(firsts):.3f})"
              f" | {statistics.median(afters):.3f} ({min(afters):.3f}-{max(afters):.3f}) |")


if __name__ == "__main__":
    main()
