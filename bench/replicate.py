"""Benchmark: replication of snapshots to peer nodes, every part in one run.

    .venv/bin/python bench/replicate.py [--output bench/RESULTS.md]   # (a) to (d), side by side
    .venv/bin/python bench/replicate.py throughput|training|recovery|simulate [options]

Parts:

- (a) ``throughput``: one rank segment of ``--size-mib`` (1 GiB) in shared memory, staged as a
  rank and its store leave it, sent by ftrun's ``ReplicaSender`` to ftrun's
  ``ReplicaReceiver`` (the code a store runs, each end in a process of its own: a whole
  ``send_step``, every chunk signed, sent, verified and written into the replica segment),
  against raw pyzmq TCP (a DEALER streaming the same segment zero-copy in messages of the
  same 4 MiB to a ROUTER that drops them) between the same two endpoints, transfers
  alternating so that both see the same load. Between two network namespaces (veth over a
  bridge, ``ftrun.testing.netns``) and on loopback. Goal: >= 0.8 of raw.
- (b) ``training``: steps/s of ``examples/train.py`` (a model whose snapshot is tens of MB,
  a snapshot every step) on 3 launchers of one rank each, ``--replicas 2`` against
  ``--replicas 1``, and ``--replicas 2 --replica-rate R``; same steps, alternating order
  over ``--repeats``. Also the CPU seconds the stores and the ranks used. Goal: >= 0.97.
- (c) ``recovery``: time from the loss of a whole node (every process of one launcher
  SIGKILLed at once) to the next completed step, and the steps recomputed, for ftrun
  (``--nnodes 2:3``, 3 nodes, ``--replicas 2``, ``--persist-dir`` every ``--persist-every``)
  against torchrun tuned (``--nnodes 2:3``, c10d with a short keep-alive and last call,
  ``train.py --torch-save-dir`` every ``--save-every`` steps). Goal: ftrun <= 0.5x torchrun.
- (d) ``simulate``: over ftrun's own placement code (``ftrun.coordinator.placement``), the
  probability that ``k`` simultaneous node losses, every set of ``k`` nodes equally likely,
  leave a copy of every node's snapshot shards in some live node's memory, for Gemini's group
  placement (mixed when ``m`` does not divide ``N``) against ring placement. Exact (every loss
  set enumerated) while there are at most ``--exact-limit`` loss sets, otherwise a Monte
  Carlo estimate from ``--trials`` sets drawn with a fixed seed (the standard error is
  printed). It must reproduce Gemini's figures, N=16, m=2: k=2 93.3%, k=3 80.0%, and exits 1
  if it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.coordinator import placement  # noqa: E402
from ftrun.testing import (  # noqa: E402
    Launchers,
    cmdline,
    free_port,
    git_tree,
    read_jsonl,
    tree_pids,
)
from ftrun.testing.netns import Cluster  # noqa: E402
from ftrun.testing.netns import unavailable_reason as netns_available  # noqa: E402

VENV = Path(sys.executable).parent
PEER = ROOT / "bench" / "_replica_peer.py"
TRAIN = ROOT / "examples" / "train.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# (c) c10d's dead-node detection as ftrun tunes it by default (keep-alive 2 s x 3, last call
# 5 s), given to both launchers so that they differ only in what they do about the loss.
RDZV_CONF = ("join_timeout=60,close_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3,"
             "last_call_timeout=5")
TAIL_STEPS = 8  # (b) steps run after the timed ones, while `ftrun status` is asked
# -- common -------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def read_line(proc: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """The next line ``proc`` prints, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        why = "exited" if ready else f"no output within {timeout_s:g} s"
        raise RuntimeError(f"{what}: {why} (exit code {proc.poll()})")
    return line


def stop_proc(proc: subprocess.Popen[str], timeout_s: float = 20.0) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- (a) throughput -----------------------------------------------------------------------------


def throughput(where: str, size_mib: int, transfers: int, warmup: int,
               timeout_s: float) -> dict[str, Any]:
    """Store replication vs raw pyzmq between two namespaces (``netns``) or on ``loopback``."""
    run_id = f"bench-rep-{os.getpid()}-{where}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as stack:
        if where == "netns":
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ftb-ns-")))
            ns = stack.enter_context(Cluster(2, logs))
            host = ns.addr(1)
            wrap_send: Callable[[list[str]], list[str]] = lambda c: ns.wrap(0, c)  # noqa: E731
            wrap_recv: Callable[[list[str]], list[str]] = lambda c: ns.wrap(1, c)  # noqa: E731
        else:
            host = "127.0.0.1"
            wrap_send = wrap_recv = lambda c: c  # noqa: E731
        recv = subprocess.Popen(wrap_recv([sys.executable, str(PEER), "recv", "--host", host,
                                           "--run-id", run_id]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT)
        stack.callback(stop_proc, recv)
        addrs = json.loads(read_line(recv, 60, "replica receiver"))
        send = subprocess.Popen(wrap_send([
            sys.executable, str(PEER), "send", "--store", addrs["store"], "--raw", addrs["raw"],
            "--run-id", run_id, "--size-mib", str(size_mib), "--transfers", str(transfers),
            "--warmup", str(warmup)]), stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        stack.callback(stop_proc, send)
        rows, last = [], proc_cpu_s(recv.pid)
        deadline = time.monotonic() + timeout_s
        while len(rows) < warmup + 2 * transfers:
            row = json.loads(read_line(send, max(1.0, deadline - time.monotonic()),
                                       "replica sender"))
            now = proc_cpu_s(recv.pid)
            row["recv_cpu_s"], last = now - last, now
            rows.append(row)
        send.wait(timeout=60)
        if send.returncode:
            raise RuntimeError(f"the replica sender exited with {send.returncode}")
    out: dict[str, Any] = {"where": where, "host": host, "rows": rows}
    for mode in ("raw", "store"):
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = {
            "gb_s": median([r["bytes"] / r["s"] / 1e9 for r in mine]),
            "send_cpu_s_gb": median([r["cpu_s"] / (r["bytes"] / 1e9) for r in mine]),
            "recv_cpu_s_gb": median([r["recv_cpu_s"] / (r["bytes"] / 1e9) for r in mine]),
        }
    pairs = [(r, s) for r in rows for s in rows
             if r["mode"] == "raw" and s["mode"] == "store" and r["transfer"] == s["transfer"]]
    out["ratio"] = out["store"]["gb_s"] / out["raw"]["gb_s"]
    out["pair_ratios"] = [rr["s"] / ss["s"] for rr, ss in pairs]
    return out


def throughput_table(results: list[dict[str, Any]]) -> str:
    lines = ["| between | raw pyzmq GB/s | ftrun replication GB/s | ratio (goal >= 0.8) | "
             "per-transfer ratios | CPU s/GB raw send + recv | CPU s/GB replication send + "
             "recv |", "|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        raw, store = r["raw"], r["store"]
        where = ("two network namespaces (veth, bridge)" if r["where"] == "netns"
                 else "loopback")
        lines.append(
            f"| {where} | {raw['gb_s']:.2f} | {store['gb_s']:.2f} | **{r['ratio']:.2f}** | "
            f"{', '.join(f'{x:.2f}' for x in r['pair_ratios'])} | "
            f"{raw['send_cpu_s_gb']:.2f} + {raw['recv_cpu_s_gb']:.2f} | "
            f"{store['send_cpu_s_gb']:.2f} + {store['recv_cpu_s_gb']:.2f} |")
    return "\n".join(lines)


# -- jobs of 3 launchers (parts b and c) ----------------------------------------------------------


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--heads", "4",
            "--batch", "6", "--seq-len", "32", "--vocab", "256"]


def snapshot_mb(args: argparse.Namespace) -> float:
    """Params + AdamW's two moments of train.py's GPT at ``--dim``/``--layers``, in MB."""
    sys.path.insert(0, str(TRAIN.parent))
    from train import GPT  # type: ignore[import-not-found]

    n = sum(p.numel() for p in GPT(256, 32, args.dim, 4, args.layers).parameters())
    return 3 * 4 * n / 1e6


def classify(pid: int) -> str:
    """``store``, ``rank`` or ``launcher`` (the launcher with its agent, and anything else)."""
    argv = cmdline(pid)
    if "ftrun.store.store" in argv:  # python -m ftrun.store.store
        return "store"
    if any(a.endswith(("/ftrun", "/torchrun")) for a in argv[:2]):
        return "launcher"  # its command line names train.py too
    return "rank" if any(a.endswith("train.py") for a in argv) else "launcher"


class CpuSampler:
    """CPU seconds of every process under some launchers, by kind, sampled every
    ``every_s`` (a process that exits loses at most its last interval)."""

    def __init__(self, roots: Sequence[int]) -> None:
        self.roots = list(roots)
        self.seen: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        for root in self.roots:
            for pid in tree_pids(root):
                cpu = proc_cpu_s(pid)
                if cpu:
                    kind = self.seen.get(pid, (classify(pid), 0.0))[0]
                    self.seen[pid] = (kind, cpu)

    def by_kind(self) -> dict[str, float]:
        out = {"store": 0.0, "rank": 0.0, "launcher": 0.0}
        for kind, cpu in self.seen.values():
            out[kind] += cpu
        return out


def listening_pid(port: int, pids: Sequence[int]) -> int | None:
    """Which of ``pids`` holds the TCP socket listening on ``port`` (the rendezvous store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                    inodes.add(f"socket:[{parts[9]}]")
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
    return None


class Hosts:
    """One launcher per simulated host, each with shared memory of its own
    (``FTRUN_SHM_DIR``): a killed host's snapshots are gone with it, as on a real host,
    instead of being adopted from ``/dev/shm`` by a survivor."""

    def __init__(self, cmd: Sequence[str], n: int, env: dict[str, str], work: Path,
                 tag: str) -> None:
        base = Path(os.environ.get("FTRUN_SHM_DIR", "/dev/shm"))
        self.shm = [base / f"{tag}-host{i}" for i in range(n)]
        self.nodes: list[Launchers] = []
        for i, shm in enumerate(self.shm):
            shm.mkdir(parents=True, exist_ok=True)
            self.nodes.append(Launchers(cmd, 1, {**env, "FTRUN_SHM_DIR": str(shm)}, work,
                                        f"{tag}-host{i}", ROOT))

    @property
    def pids(self) -> list[int]:
        return [n.pids[0] for n in self.nodes]

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [n.procs[0] for n in self.nodes]

    def codes(self) -> list[int | None]:
        return [n.codes()[0] for n in self.nodes]

    def running(self) -> bool:
        return any(n.running() for n in self.nodes)

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        return [n.wait(max(0.0, deadline - time.monotonic()))[0] for n in self.nodes]

    def lose(self, i: int) -> float:
        """SIGKILL every process of host ``i`` at once and drop its memory; returns when."""
        doomed = tree_pids(self.pids[i])
        at = time.time()
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.nodes[i].kill()
        shutil.rmtree(self.shm[i], ignore_errors=True)
        return at

    def kill(self) -> int:
        left = sum(n.kill() for n in self.nodes)
        for shm in self.shm:
            shutil.rmtree(shm, ignore_errors=True)
        return left

    def tail(self) -> str:
        return "\n".join(n.tail() for n in self.nodes)


def wait_steps(path: Path, cond: Callable[[list[dict[str, Any]]], bool], job: Hosts,
               timeout_s: float, what: str, sampler: CpuSampler | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond(read_jsonl(path)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s\n{job.tail()}")
        if not job.running():
            raise RuntimeError(f"{what}: the launchers exited {job.codes()}\n{job.tail()}")
        if sampler is not None:
            sampler.sample()
        time.sleep(0.25)


def ftrun_cmd(nnodes: str, port: int, run_id: str, extra: Sequence[str]) -> list[str]:
    return [str(VENV / "ftrun"), "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *extra]


# -- (b) training throughput ----------------------------------------------------------------------


def training_run(tag: str, extra: Sequence[str], args: argparse.Namespace,
                 work: Path) -> dict[str, Any]:
    run_id = f"benchrep-{tag}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    steplog = work / f"{run_id}.steps"
    cmd = [*ftrun_cmd("3", port, run_id, ["--replica-addr", "127.0.0.1", *extra]), str(TRAIN),
           *model_args(args), "--steps", str(args.train_steps + TAIL_STEPS),
           "--snapshot-every", "1",
           "--step-log", str(steplog)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FTRUN_STATE_DIR": str(work / "state")}
    job = Hosts(cmd, 3, env, work, run_id)
    try:
        sampler = CpuSampler(job.pids)
        wait_steps(steplog, lambda s: len(s) >= args.train_warmup, job, args.job_timeout,
                   f"{tag}: step {args.train_warmup}")
        sampler.sample()
        before = sampler.by_kind()
        wait_steps(steplog, lambda s: len(s) >= args.train_steps, job, args.job_timeout,
                   f"{tag}: step {args.train_steps}", sampler)
        sampler.sample()
        after = sampler.by_kind()
        status = job_status(run_id, work)  # while the last TAIL_STEPS run
        codes = job.wait(args.job_timeout)
        if codes != [0, 0, 0]:
            raise RuntimeError(f"{tag}: launchers exited {codes}\n{job.tail()}")
        status.setdefault("committed_step", None)
    finally:
        left = job.kill()
    steps = read_jsonl(steplog)
    timed = [s for s in steps if args.train_warmup < s["step"] <= args.train_steps]
    span = timed[-1]["time"] - steps[args.train_warmup - 1]["time"]
    cpu = {k: after[k] - before[k] for k in after}
    return {"tag": tag, "steps_s": len(timed) / span, "span_s": span, "steps": len(timed),
            "cpu": cpu, "left": left, "replication": status}


def job_status(run_id: str, work: Path) -> dict[str, Any]:
    """The replication counters in ``ftrun status`` (empty once the job is over)."""
    out = subprocess.run([str(VENV / "ftrun"), "status", run_id, "--json"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT),
                              "FTRUN_STATE_DIR": str(work / "state")})
    with contextlib.suppress(ValueError):
        snaps = (json.loads(out.stdout) or {}).get("snapshots") or {}
        return {k: snaps.get(k) for k in ("committed_step", "durable_step")}
    return {}


def training(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    variants = [("replicas 1", ["--replicas", "1"]),
                ("replicas 2", ["--replicas", "2"]),
                (f"replicas 2, --replica-rate {args.rate:g}",
                 ["--replicas", "2", "--replica-rate", str(args.rate)])]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, extra in order:
            res = training_run(name.replace(" ", "").replace(",", "-").replace("--", ""),
                               extra, args, work)
            runs[name].append(res)
            print(f"  (b) {name}: {res['steps_s']:.3f} steps/s, CPU s {res['cpu']}", flush=True)
    return {"runs": runs, "snapshot_mb": snapshot_mb(args)}


def training_table(res: dict[str, Any]) -> str:
    runs = res["runs"]
    base = median([r["steps_s"] for r in runs["replicas 1"]])
    lines = ["| variant | steps/s (median) | per run | ratio to --replicas 1 (goal >= 0.97) "
             "| CPU s per step: stores / ranks / launchers | committed / durable step "
             f"(`ftrun status` at step {TAIL_STEPS} before the end) |",
             "|---|---:|---|---:|---|---|"]
    for name, rs in runs.items():
        med = median([r["steps_s"] for r in rs])
        cpu = {k: median([r["cpu"][k] / r["steps"] for r in rs]) for k in rs[0]["cpu"]}
        each = ", ".join(f"{r['steps_s']:.3f}" for r in rs)
        lines.append(f"| {name} | {med:.3f} | {each} | "
                     f"**{med / base:.3f}** | {cpu['store']:.3f} / {cpu['rank']:.3f} / "
                     f"{cpu['launcher']:.3f} | "
                     + ", ".join(f"{r['replication'].get('committed_step')} / "
                                 f"{r['replication'].get('durable_step')}" for r in rs) + " |")
    return "\n".join(lines)


# -- (c) node loss ------------------------------------------------------------------------------


def torchrun_cmd(port: int, run_id: str, conf: str) -> list[str]:
    return [str(VENV / "torchrun"), "--nnodes", "2:3", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", conf, "--max-restarts", "3"]


def node_loss(launcher: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_id = f"benchrep-loss-{launcher}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    steplog = work / f"{run_id}.steps"
    train = [*model_args(args), "--steps", str(args.loss_steps), "--step-sleep",
             str(args.step_sleep), "--step-log", str(steplog)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FTRUN_STATE_DIR": str(work / "state")}
    if launcher == "ftrun":
        cmd = [*ftrun_cmd("2:3", port, run_id, [
            "--rdzv-conf", args.rdzv_conf, "--replicas", "2", "--replica-addr", "127.0.0.1",
            "--max-restarts", "3", "--persist-dir", str(work / f"{run_id}-persist"),
            "--persist-every", str(args.save_every)]), str(TRAIN), *train, "--snapshot-every",
            "1"]
    else:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [*torchrun_cmd(port, run_id, args.rdzv_conf), str(TRAIN), *train,
               "--snapshot-every", "0", "--torch-save-dir", str(work / f"{run_id}-ckpt"),
               "--torch-save-every", str(args.save_every)]
    job = Hosts(cmd, 3, env, work, run_id)
    try:
        wait_steps(steplog, lambda s: any(x["step"] >= args.kill_step for x in s), job,
                   args.job_timeout, f"(c) {launcher}: step {args.kill_step}")
        host = listening_pid(port, [p for root in job.pids for p in tree_pids(root)])
        victim = next(i for i, root in enumerate(job.pids) if host not in tree_pids(root))
        before = read_jsonl(steplog)
        killed_at = job.lose(victim)
        restart0 = max(s["restart"] for s in before)
        last_done = max(s["step"] for s in before if s["time"] <= killed_at)
        wait_steps(steplog, lambda s: any(x["restart"] > restart0 or x["time"] > killed_at
                                          and x["step"] <= last_done for x in s),
                   job, args.job_timeout, f"(c) {launcher}: a step after the node loss")
        steps = read_jsonl(steplog)
        first = next(s for s in steps if s["time"] > killed_at
                     and (s["restart"] > restart0 or s["step"] <= last_done))
        # Let the job finish on the survivors: a whole run, not just one step.
        survivors = [p for i, p in enumerate(job.procs) if i != victim]
        deadline = time.monotonic() + args.job_timeout
        for p in survivors:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.poll() for p in survivors]
        steps = read_jsonl(steplog)
        finished = max(s["step"] for s in steps) == args.loss_steps
        new = next((s for s in steps if s["time"] > killed_at and s["step"] > last_done), None)
    finally:
        left = job.kill()
    return {"launcher": launcher, "loss_to_step_s": first["time"] - killed_at,
            "loss_to_new_step_s": new["time"] - killed_at if new else float("nan"),
            "resumed_from": first["step"] - 1, "last_done": last_done,
            "recomputed": max(0, last_done - (first["step"] - 1)), "victim": victim,
            "codes": codes, "finished": finished, "left": left}


def recovery(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"ftrun": [], "torchrun": []}
    for r in range(args.loss_repeats):
        for launcher in ("ftrun", "torchrun") if r % 2 == 0 else ("torchrun", "ftrun"):
            res = node_loss(launcher, args, work)
            runs[launcher].append(res)
            print(f"  (c) {launcher}: {res}", flush=True)
    return {"runs": runs}


def recovery_table(res: dict[str, Any]) -> str:
    runs = res["runs"]
    t = {k: median([r["loss_to_step_s"] for r in v]) for k, v in runs.items()}
    n = {k: median([r["loss_to_new_step_s"] for r in v]) for k, v in runs.items()}
    lines = ["| launcher | node loss -> next step (median s) | per run | vs torchrun (goal <= "
             "0.5) | resumed from / last step done | steps recomputed | node loss -> first step "
             "beyond the last one done (median s) | vs torchrun | finished on 2 nodes |",
             "|---|---:|---|---:|---|---:|---:|---:|---|"]
    for k, v in runs.items():
        each = ", ".join(f"{r['loss_to_step_s']:.2f}" for r in v)
        where = ", ".join(f"{r['resumed_from']} / {r['last_done']}" for r in v)
        lines.append(
            f"| {k} | {t[k]:.2f} | {each} | **{t[k] / t['torchrun']:.2f}** | {where} | "
            f"{', '.join(str(r['recomputed']) for r in v)} | {n[k]:.2f} | "
            f"{n[k] / n['torchrun']:.2f} | "
            f"{', '.join('yes' if r['finished'] else 'no' for r in v)} |")
    return "\n".join(lines)


# -- (d) placement simulation ----------------------------------------------------------------

NODES = (16, 64, 256, 1024)
COPIES = (2, 3)
LOSSES = (1, 2, 3, 4)
# Gemini (SOSP'23), N=16, m=2, group placement: (k, recovery probability in percent).
GEMINI = ((2, 93.3), (3, 80.0))


def simulate(nodes: tuple[int, ...], copies: tuple[int, ...], losses: tuple[int, ...],
             exact_limit: int, trials: int) -> list[dict[str, object]]:
    rows = []
    for n in nodes:
        ids = placement.node_ids(n)
        for m in copies:
            for k in losses:
                row: dict[str, object] = {"N": n, "m": m, "k": k}
                for name, place in placement.STRATEGIES.items():
                    est = placement.recovery_probability(place(ids, m), k,
                                                         exact_limit=exact_limit, trials=trials)
                    row[name] = est.probability
                    row[f"{name}_stderr"] = est.stderr
                    row["exact"] = est.exact
                    row["trials"] = est.trials
                rows.append(row)
    return rows


def _pct(p: float, se: float, exact: bool, trials: int) -> str:
    if not exact and p == 1.0:
        # No failure drawn: one standard error says nothing; give the 95% bound instead
        # (rule of three: the failure rate is below 3/trials).
        return f"> {100 * (1 - 3 / trials):.4f}% (no loss in {trials:,})"
    return f"{100 * p:.4f}%" + (f" ±{100 * se:.2g}" if se else "")


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| N | m | k | group | ring | how |", "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        how = (f"exact ({r['trials']:,} loss sets)" if r["exact"]
               else f"Monte Carlo ({r['trials']:,} draws, seed {placement.MC_SEED})")
        lines.append(f"| {r['N']} | {r['m']} | {r['k']} | "
                     f"{_pct(r['group'], r['group_stderr'], r['exact'], r['trials'])} | "  # type: ignore[arg-type]
                     f"{_pct(r['ring'], r['ring_stderr'], r['exact'], r['trials'])} | {how} |")  # type: ignore[arg-type]
    return "\n".join(lines)


def check_gemini() -> list[str]:
    """Gemini's published figures, recomputed; returns what does not match."""
    group = placement.group_placement(placement.node_ids(16), 2)
    wrong = []
    for k, want in GEMINI:
        got = 100 * placement.recovery_probability(group, k).probability
        if round(got, 1) != want:
            wrong.append(f"N=16 m=2 k={k}: {got:.2f}% (Gemini: {want}%)")
    return wrong


def hardware() -> str:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({model or 'unknown model'}), {mem:.0f} GiB, no GPU used"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", default="all",
                   choices=("all", "throughput", "training", "recovery", "simulate"))
    p.add_argument("--output", type=Path, help="append the results to this file (RESULTS.md)")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--work-dir", type=Path,
                   help="keep the jobs' logs, step logs and checkpoints here (default: a "
                   "temporary directory, removed)")
    a = p.add_argument_group("(a) throughput")
    a.add_argument("--size-mib", type=int, default=1024, help="the rank segment sent (MiB)")
    a.add_argument("--transfers", type=int, default=3, help="timed transfers each way")
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--where", nargs="+", default=["netns", "loopback"],
                   choices=("netns", "loopback"))
    b = p.add_argument_group("(b) training and (c) node loss")
    b.add_argument("--dim", type=int, default=256, help="train.py --dim")
    b.add_argument("--layers", type=int, default=4, help="train.py --layers")
    b.add_argument("--train-steps", type=int, default=40)
    b.add_argument("--train-warmup", type=int, default=10, help="steps not timed")
    b.add_argument("--rate", type=float, default=20.0, help="--replica-rate MB/s")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--loss-steps", type=int, default=40)
    b.add_argument("--kill-step", type=int, default=13,
                   help="(c) the step in which a host is lost (13: 3 steps after a save)")
    b.add_argument("--save-every", type=int, default=5,
                   help="torchrun's torch.save and ftrun's --persist-every, in steps")
    b.add_argument("--step-sleep", type=float, default=0.1)
    b.add_argument("--loss-repeats", type=int, default=1)
    b.add_argument("--rdzv-conf", default=RDZV_CONF,
                   help="(c) the c10d tuning both launchers get (default: ftrun's own)")
    b.add_argument("--job-timeout", type=float, default=240.0)
    d = p.add_argument_group("(d) simulate")
    d.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    d.add_argument("--copies", type=int, nargs="+", default=list(COPIES),
                   help="m: copies of every shard (the node's own and m-1 replicas)")
    d.add_argument("--losses", type=int, nargs="+", default=list(LOSSES))
    d.add_argument("--exact-limit", type=int, default=placement.EXACT_LIMIT,
                   help="enumerate every loss set up to this many; sample beyond")
    d.add_argument("--trials", type=int, default=placement.MC_TRIALS)
    return p.parse_args(argv)


def run_simulate(args: argparse.Namespace) -> tuple[str, list[dict[str, object]], bool]:
    t0 = time.perf_counter()
    rows = simulate(tuple(args.nodes), tuple(args.copies), tuple(args.losses),
                    args.exact_limit, args.trials)
    wrong = check_gemini()
    text = ("(d) Probability that k simultaneous node losses (every set of k nodes equally "
            "likely) leave a copy of every node's shards in memory, for ftrun's placement code "
            "(ftrun.coordinator.placement): Gemini's group placement (mixed when m does not divide "
            "N: ring over the last m + N mod m nodes) vs ring placement. m = copies of each "
            f"shard. Exact enumeration up to {args.exact_limit:,} loss sets, else Monte Carlo "
            f"(± one standard error). {time.perf_counter() - t0:.1f} s.\n\n{table(rows)}\n\n"
            "Gemini's figures (N=16, m=2, group: k=2 93.3%, k=3 80.0%): "
            + ("reproduced" if not wrong else "NOT reproduced: " + "; ".join(wrong)))
    return text, rows, not wrong


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = ["throughput", "training", "recovery", "simulate"] if args.part == "all" \
        else [args.part]
    started = datetime.now(timezone.utc)
    loads = [load()]
    sections: list[str] = []
    record: dict[str, Any] = {}
    ok = True
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            work = args.work_dir
        else:
            work = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="ftrun-bench-replicate-")))
        if "throughput" in parts:
            why = netns_available()
            if why and "netns" in args.where:
                print(f"(a) between network namespaces skipped: {why}", flush=True)
            res = [throughput(w, args.size_mib, args.transfers, args.warmup, args.job_timeout)
                   for w in args.where if w != "netns" or not why]
            record["throughput"] = res
            sections.append(
                f"(a) Replication of one rank segment of {args.size_mib} MiB (chunks of 4 MiB), "
                "ftrun's ReplicaSender to ftrun's ReplicaReceiver, each in a process of its "
                "own, against raw pyzmq (DEALER to ROUTER, the same segment sent zero-copy in "
                f"4 MiB messages), same endpoints; {args.transfers} timed transfers each way, "
                f"alternating, after {args.warmup} that create the replica segments. CPU: the "
                "sender process (ZeroMQ's I/O thread included) and the receiver process, per GB "
                f"sent (medians).\n\n{throughput_table(res)}")
            loads.append(load())
        if "training" in parts:
            res_b = training(args, work)
            record["training"] = res_b
            sections.append(
                f"(b) examples/train.py (--dim {args.dim} --layers {args.layers}: a snapshot of "
                f"{res_b['snapshot_mb']:.0f} MB per rank, params + AdamW moments), 3 launchers "
                "of 1 rank each on this host (c10d), a snapshot every step; steps/s over steps "
                f"{args.train_warmup + 1}..{args.train_steps} from rank 0's step log; "
                f"{args.repeats} run(s) per variant, alternating order. CPU seconds per step "
                "of every store, rank and launcher process of the job over the same steps."
                f"\n\n{training_table(res_b)}")
            loads.append(load())
        if "recovery" in parts:
            res_c = recovery(args, work)
            record["recovery"] = res_c
            sections.append(
                "(c) Node loss: 3 launchers of 1 rank each on this host, each with shared memory "
                "of its own (FTRUN_SHM_DIR), `--nnodes 2:3`; in step "
                f"{args.kill_step} every process of one launcher (not the one hosting the "
                "rendezvous store and the coordinator) is SIGKILLed at once and its shared "
                "memory removed; time from the kill to the first step completed after it, and "
                "to the first step beyond the last one completed before it (rank 0's step "
                "log), and the steps done again. ftrun: "
                f"--replicas 2, a snapshot every step, --persist-dir every {args.save_every} "
                "steps. torchrun: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, train.py "
                f"--torch-save-dir every {args.save_every} steps. Both: c10d with --rdzv-conf "
                f"{args.rdzv_conf}, --step-sleep {args.step_sleep}.\n\n"
                f"{recovery_table(res_c)}")
            loads.append(load())
        if "simulate" in parts:
            text, rows, ok = run_simulate(args)
            record["simulate"] = rows
            sections.append(text)
    cmd = " ".join(["python bench/replicate.py", *(argv if argv is not None else sys.argv[1:])])
    head = (f"`{cmd}` on {started:%Y-%m-%d %H:%M} UTC, code {git_tree()}; {hardware()}; load "
            f"average (1/5/15 min) at start and after each part: {', '.join(loads)}.")
    text = head + "\n\n" + "\n\n".join(sections)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    if args.output:
        with open(args.output, "a") as f:
            f.write(f"\n## Replication to peer nodes: throughput, training, node loss, placement"
                    f"\n\n{text}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
