"""Benchmark: what a per-step in-memory snapshot costs, ftrun vs DLRover, torch.save and DCP.

One command, every part side by side in the same run::

    .venv/bin/python bench/snapshot.py [--device cuda|cpu] [--size-gib 1.0] [--steps 16]
                                       [--output bench/RESULTS.md]

The training state is a stack of transformer MLP blocks (LayerNorm, dim -> 4 dim -> dim) with
AdamW, at least ``--size-gib`` of params + exp_avg + exp_avg_sq (fp32), trained on the CPU by
one rank (gloo, world size 1: on two cores a single process keeps the figures honest). Each
step is a real forward, backward and ``AdamW.step()`` on a batch of ``--batch`` rows.

(a) Step time with ``Snapshotter.save()`` every step vs without, under
    ``ftrun --standalone --nproc-per-node 1`` (so ftrun's store hashes every snapshot), finely
    interleaved in one process so that a drifting (shared) machine hits both alike: save, save
    (counted: the previous save's copy and hash overlap it, as in steady state), untimed settle
    (copy staged and hashed), no save (counted); ``--steps`` times. Once with
    ``async_copy=True``, once with ``False``.
(b) Blocking time per save: for ftrun the time inside ``save()`` plus ``snap.wait()`` right
    before the next ``optimizer.step()`` (the pre-hook's wait); under plain ``torchrun`` with
    the same model and step: DLRover ``DdpCheckpointer.save_checkpoint(..., StorageType.MEMORY)``
    (its agent-less mode: the engine forks its own saver process), ``torch.save`` to
    ``/dev/shm``, and ``torch.distributed.checkpoint.async_save`` (staging plus the wait for
    the previous save). Every method saves the same DCP state dicts, built in the timed part.
(c) Staging bandwidth: ftrun's copy into its pre-faulted buffer (its writer thread's time
    minus the claim round trip to the store, ``async_copy=False`` so nothing else runs) vs a
    plain ``torch`` copy of the same tensors into a pre-faulted file in ``/dev/shm``.
(d) Restore: the rank exits on purpose, ftrun restarts it, and the new process times
    ``snap.restore()`` (hash check + load + apply) and then ``torch.load`` of the same state
    from ``/dev/shm`` plus ``load_state_dict`` into the model and a fresh optimizer.
(e) Step length: the copy time is measured first (the reference copy of (c)); then the pairs
    of (a) (async job) at a short step (``--short-batch`` rows) and at a step about three
    times the copy (the batch size is fitted from measured steps).
(f) ``every="auto"``: a job of its own, at the two batch sizes of (e): steps without
    ``save()``, two agreements on the interval, a whole number of intervals with ``save()``
    called every step, steps without again; throughput ratio = mean step without / with, and
    the interval chosen (``Snapshotter.every``).

``--device`` (default: ``cuda`` when torch sees a GPU, else ``cpu``) picks where the rank
trains. On ``cuda`` it trains as GPU users do (bf16 autocast, fused AdamW, NCCL), step times
end with the compute stream's work (CUDA synchronize of that stream, not of ftrun's copy
stream), and the reference of (c) is a ``non_blocking`` device-to-host copy of the same
tensors into pinned memory, timed with CUDA events: the limit for staging. On ``cpu`` the
reference is a copy into a pre-faulted ``/dev/shm`` file.

Every launcher runs in a session of its own with a timeout; on a timeout or an error its process
group and every process seen below it are killed. Shared memory goes to a private directory
on ``/dev/shm`` (ftrun's ``FTRUN_SHM_DIR``) that is removed at the end, as are DLRover's
``{run_id}_ckpt_shm_*`` segments and ``/tmp/ckpt_sock/{run_id}`` of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ftrun.testing import free_port, git_tree

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "_snapshot_worker.py"
BIN = Path(sys.executable).parent
HEADING = "Snapshots (issue: in-memory snapshots)"
DLROVER_SOCK_DIR = Path("/tmp/ckpt_sock")
GIB = 2**30
GOAL_THROUGHPUT = 0.97
GOAL_BANDWIDTH = 0.8  # CPU: ftrun's staging bandwidth / a plain copy's
GOAL_STAGING = 1.25  # GPU: ftrun's staging time / the pinned non_blocking copy's
GOAL_RESTORE = 0.5  # restore() / torch.load + load_state_dict
DISTURBED_CORES = 0.25


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, int, float]]:
    """pid -> (ppid, start ticks, CPU seconds) of every process visible in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().decode(errors="replace").rpartition(")")[2].split()
            out[int(entry.name)] = (int(fields[1]), int(fields[19]),
                                    (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _note_descendants(root: int, seen: dict[int, int], cpu: dict[int, float]) -> None:
    """Add every live descendant of ``root`` to ``seen`` (pid -> start ticks), and note the CPU
    seconds each has used so far in ``cpu``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    if root in table:
        cpu[root] = table[root][2]
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in seen:
                seen[child] = table[child][1]
            if seen[child] == table[child][1]:
                cpu[child] = table[child][2]
            stack.append(child)


def _kill_seen(seen: dict[int, int]) -> list[int]:
    """SIGKILL the processes in ``seen`` that still run (same pid and start time)."""
    table = _proc_table()
    killed = []
    for pid, start in seen.items():
        if pid in table and table[pid][1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


@dataclass
class Job:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    timeout_s: float
    rc: int | None = None
    wall_s: float = 0.0
    stragglers: list[int] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU time of the launcher and every process it waited for
    busy_s: float = 0.0  # CPU time of the whole machine meanwhile

    @property
    def foreign_cores(self) -> float:
        """Cores used on average by processes that are not this job's, while it ran."""
        return max(0.0, self.busy_s - self.cpu_s) / self.wall_s if self.wall_s else 0.0


def busy_cpu_s() -> float:
    """CPU seconds spent so far by the whole machine (not idle, not waiting for I/O)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_cores: float, max_wait_s: float) -> float:
    """Wait (at most ``max_wait_s``) until other processes use < ``max_cores`` cores over 2 s;
    returns the last figure."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = busy_cpu_s(), time.monotonic()
        time.sleep(2.0)
        cores = (busy_cpu_s() - b0) / (time.monotonic() - t0)
        if cores < max_cores or time.monotonic() >= deadline:
            return cores


def run_job(job: Job) -> None:
    """Run ``job`` in its own session; kill its group and every process seen below it on a
    timeout or an error, and any of them still running after it exits."""
    seen: dict[int, int] = {}
    cpu: dict[int, float] = {}
    t0, busy0 = time.monotonic(), busy_cpu_s()
    with open(job.log, "wb") as log:
        proc = subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT, env=job.env,
                                cwd=ROOT, start_new_session=True)
    try:
        while True:
            _note_descendants(proc.pid, seen, cpu)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # rusage: the job's CPU time
            if pid:
                proc.returncode = job.rc = os.waitstatus_to_exitcode(status)
                # Children it reaped count in its rusage; the others were sampled meanwhile.
                job.cpu_s = max(usage.ru_utime + usage.ru_stime, sum(cpu.values()))
                job.busy_s = busy_cpu_s() - busy0
                break
            if time.monotonic() - t0 > job.timeout_s:
                raise TimeoutError(f"{job.name}: no result within {job.timeout_s:.0f} s")
            time.sleep(0.25)
    except BaseException:
        _note_descendants(proc.pid, seen, cpu)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_seen(seen)
        proc.wait(timeout=30)
        raise
    finally:
        job.wall_s = time.monotonic() - t0
        job.stragglers = _kill_seen(seen)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measured(steps: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    return [s for s in steps if s["mode"] == mode and s["measured"]]


@dataclass
class FtrunRun:
    """The raw measurements of one ftrun job (one ``async_copy`` setting)."""

    label: str
    doc: dict[str, Any]

    @property
    def none_s(self) -> list[float]:
        return [s["s"] for s in measured(self.doc["steps"], "none")]

    @property
    def snap_s(self) -> list[float]:
        return [s["s"] for s in measured(self.doc["steps"], "snap")]

    @property
    def pair_ratios(self) -> list[float]:
        """Per pair (counted snap step, the counted none step after it): none / snap."""
        steps = self.doc["steps"]
        ratios = []
        for i, st in enumerate(steps):
            if st["mode"] == "snap" and st["measured"]:
                nxt = next((x for x in steps[i + 1:] if x["measured"]), None)
                if nxt is not None and nxt["mode"] == "none":
                    ratios.append(nxt["s"] / st["s"])
        return ratios

    @property
    def throughput(self) -> float:
        """Steps per second with snapshots / without: the median of the per-pair ratios (robust
        to a machine whose speed drifts, as a shared one does)."""
        return med(self.pair_ratios)

    @property
    def throughput_of_medians(self) -> float:
        return med(self.none_s) / med(self.snap_s)

    def blocking(self) -> tuple[list[float], list[float], list[float]]:
        """(total, inside save(), wait before optimizer.step()) of the counted snapshot steps.

        A counted step's wait is for the previous step's save (steady state: one save in
        flight), so save() + wait is what one save costs the training loop."""
        rows = [s for s in measured(self.doc["steps"], "snap") if s["saved"]]
        inside = [s["save_s"] for s in rows]
        wait = [s["wait_s"] for s in rows]
        return [a + b for a, b in zip(inside, wait, strict=True)], inside, wait

    def training_copies(self) -> list[float]:
        """ftrun's copy time (writer minus claim) of the saves in the counted training steps."""
        keep = {s["step"] for s in measured(self.doc["steps"], "snap")}
        return [w - c for step, w, c in self.doc["writes"] if step in keep]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def fmt_s(x: float) -> str:
    if x != x:  # nan
        return "n/a"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


BASELINES = {
    "dlrover": "DLRover DdpCheckpointer.save_checkpoint(StorageType.MEMORY)",
    "torch.save": "torch.save → /dev/shm",
    "dcp": "DCP async_save (blocking part)",
}


@dataclass
class Results:
    """Every figure of the report, from the raw measurements of the four jobs."""

    a: FtrunRun
    s: FtrunRun
    base: dict[str, Any]
    restore: dict[str, Any] | None
    load: dict[str, Any] | None
    auto: dict[str, Any] | None = None

    @property
    def cuda(self) -> bool:
        return self.a.doc.get("device") == "cuda"

    def lengths(self) -> list[tuple[dict[str, Any], FtrunRun]]:
        """(part, its pairs) of (e): the short step, then the one about 3x the copy."""
        parts = (self.a.doc.get("lengths") or {}).get("parts", [])
        return [(p, FtrunRun(f"{p['label']} step, batch {p['rows']}", {"steps": p["steps"]}))
                for p in parts]

    def block_ftrun(self, run: FtrunRun) -> float:
        return med(run.blocking()[0])

    @property
    def skipped(self) -> dict[str, str]:
        """Baselines the baselines' job left out, with the reason (DLRover not installed)."""
        return dict(self.base.get("skipped") or {})

    def block_base(self, key: str) -> float:
        return med([x["save_s"] for x in measured(self.base["steps"], key)])

    def step_base(self, key: str) -> float:
        return med([x["s"] for x in measured(self.base["steps"], key)])

    @property
    def copy_bytes(self) -> int:
        return int(self.s.doc["copy_bytes"])

    @property
    def bw_ftrun(self) -> float:
        return gbps(self.copy_bytes, med(self.s.doc["ftrun_copy_s"]))

    @property
    def bw_plain(self) -> float:
        return gbps(self.copy_bytes, med(self.s.doc["ref_copy_s"]))

    @property
    def restore_s(self) -> float:
        return float(self.restore["restore_s"]) if self.restore else float("nan")

    @property
    def load_s(self) -> float:
        """torch.load + load_state_dict, first in a fresh process (like restore())."""
        return float(self.load["torch_load_apply_s"][0]) if self.load else float("nan")


def auto_ratio(part: dict[str, Any]) -> float:
    """(f): median step without save() / mean step with save() under every="auto" (a whole
    number of intervals: each snapshot's cost is in the mean once per interval; a step slowed
    by something else counts against ftrun)."""
    return med(part["none_s"]) / statistics.fmean(part["auto_s"])


def print_e(doc: dict[str, Any]) -> None:
    lengths = doc.get("lengths")
    if not lengths:
        return
    copy = lengths["copy_s"]
    for p in lengths["parts"]:
        run = FtrunRun(p["label"], {"steps": p["steps"]})
        print(f"(e) {p['label']} step (batch {p['rows']}): {fmt_s(med(run.none_s))} = "
              f"{med(run.none_s) / copy:.1f}x the copy ({fmt_s(copy)}); with save() every "
              f"step {fmt_s(med(run.snap_s))} -> throughput ratio {run.throughput:.3f}",
              flush=True)


def print_f(doc: dict[str, Any]) -> None:
    for p in doc["parts"]:
        print(f"(f) every='auto', batch {p['rows']}: interval {p['every']} -> throughput ratio "
              f"{auto_ratio(p):.3f} (goal >= {GOAL_THROUGHPUT})", flush=True)


def print_a(run: FtrunRun) -> None:
    print(f"(a) {run.label}: step {fmt_s(med(run.snap_s))} with save() every step, "
          f"{fmt_s(med(run.none_s))} without -> throughput ratio {run.throughput:.3f} "
          f"(median of {len(run.pair_ratios)} pairs; goal >= {GOAL_THROUGHPUT})", flush=True)


def print_c(run: FtrunRun) -> None:
    nbytes = run.doc["copy_bytes"]
    ft = gbps(nbytes, med(run.doc["ftrun_copy_s"]))
    plain = gbps(nbytes, med(run.doc["ref_copy_s"]))
    if run.doc.get("device") == "cuda":
        t_ft, t_ref = med(run.doc["ftrun_copy_s"]), med(run.doc["ref_copy_s"])
        print(f"(c) staging: ftrun {fmt_s(t_ft)} ({ft:.2f} GB/s), pinned non_blocking copy "
              f"{fmt_s(t_ref)} ({plain:.2f} GB/s) -> {t_ft / t_ref:.3f}x (goal <= "
              f"{GOAL_STAGING}x)", flush=True)
        return
    print(f"(c) staging: ftrun {ft:.2f} GB/s, plain torch copy {plain:.2f} GB/s -> "
          f"{ft / plain:.3f} (goal >= {GOAL_BANDWIDTH})", flush=True)


def print_d(restore: dict[str, Any] | None, loaded: dict[str, Any] | None) -> None:
    if restore is None or loaded is None:
        print("(d) restore: not measured (no result from the restarted ranks)", flush=True)
        return
    r, t = restore["restore_s"], loaded["torch_load_apply_s"][0]
    print(f"(d) restore: snap.restore() {fmt_s(r)}, torch.load + load_state_dict {fmt_s(t)} "
          f"-> {r / t:.3f}", flush=True)


def print_b(r: Results) -> None:
    ft = r.block_ftrun(r.a)
    print(f"(b) ftrun blocking per save: {fmt_s(ft)} (async_copy=True), "
          f"{fmt_s(r.block_ftrun(r.s))} (async_copy=False)")
    for key in BASELINES:
        if key in r.skipped:
            print(f"    {key}: skipped, {r.skipped[key]}")
            continue
        b = r.block_base(key)
        print(f"    {key}: {fmt_s(b)} -> ftrun / {key} = {ft / b:.3f} (goal < 1)")
    sys.stdout.flush()


def report(cfg: argparse.Namespace, r: Results, meta: dict[str, Any]) -> tuple[str, list[str]]:
    """(Markdown section, goals not met) from the raw measurements."""
    a, s = r.a, r.s
    info = a.doc
    rows: list[str] = []
    notes: list[str] = []

    # (a)
    for run in (a, s):
        ok = run.throughput >= GOAL_THROUGHPUT
        rows.append(
            f"| (a) step time, save() every step, {run.label} | {fmt_s(med(run.snap_s))} | "
            f"{fmt_s(med(run.none_s))} (no save, same process) | throughput "
            f"{run.throughput:.3f} | ≥ {GOAL_THROUGHPUT} {verdict(ok)} |")
        if not ok:
            extra = med(run.snap_s) - med(run.none_s)
            notes.append(
                f"(a) {run.label}: throughput ratio {run.throughput:.3f}, "
                f"{GOAL_THROUGHPUT - run.throughput:.3f} below the goal (median step "
                f"{fmt_s(extra)} longer).")
    if any(run.throughput < GOAL_THROUGHPUT for run in (a, s)):
        copy, hashing = med(s.doc["ftrun_copy_s"]), med(s.doc["settle_s"])
        cost = max(med(a.snap_s) - med(a.none_s), med(s.snap_s) - med(s.none_s))
        need = cost * GOAL_THROUGHPUT / (1 - GOAL_THROUGHPUT)
        notes.append(
            f"(a) Explanation: every snapshot reads and writes {r.copy_bytes / 1e9:.2f} GB and "
            f"the rank hashes the bytes as it copies them (copy + hash {fmt_s(copy)}, see (c); "
            f"the store's check of the hash table afterwards {fmt_s(hashing)}), while forward, "
            f"backward and AdamW (memory-bound itself) already keep both cores and the memory bus "
            "busy. async_copy=True moves the copy off the training thread, but there is no idle "
            "CPU or memory bandwidth here to hide it in, so the step grows by about that work: "
            f"{fmt_s(med(a.snap_s) - med(a.none_s))} (async) and "
            f"{fmt_s(med(s.snap_s) - med(s.none_s))} (sync) by the medians. A ratio of "
            f"{GOAL_THROUGHPUT} would need steps of ≥ {fmt_s(need)} on this machine; under "
            "GPU training the CPU idles during the step and the device-to-host copy is DMA.")

    # (b)
    ft_block = r.block_ftrun(a)
    rows.append(f"| (b) blocking per save, ftrun async_copy=True: save() + wait before the next "
                f"optimizer.step() | {fmt_s(ft_block)} | | | |")
    for key, label in BASELINES.items():
        if key in r.skipped:
            rows.append(f"| (b) … vs {label} | {fmt_s(ft_block)} | skipped: "
                        f"{r.skipped[key]} | | |")
            continue
        b = r.block_base(key)
        ratio = ft_block / b
        rows.append(f"| (b) … vs {label} | {fmt_s(ft_block)} | {fmt_s(b)} | "
                    f"{ratio:.3f}× | < 1× {verdict(ratio < 1)} |")
        if ratio >= 1:
            notes.append(f"(b) ftrun blocks {ratio:.2f}× as long as {label}.")
    rows.append(f"| (b) blocking per save, ftrun async_copy=False | {fmt_s(r.block_ftrun(s))} | "
                "| | (for reference) |")

    # (c)
    frac = r.bw_ftrun / r.bw_plain
    if r.cuda:
        t_ft, t_ref = med(s.doc["ftrun_copy_s"]), med(s.doc["ref_copy_s"])
        over = t_ft / t_ref
        rows.append(f"| (c) staging time, device → shm | {fmt_s(t_ft)} ({r.bw_ftrun:.2f} GB/s) "
                    f"| {fmt_s(t_ref)} ({r.bw_plain:.2f} GB/s, pinned non_blocking copy_) | "
                    f"{over:.3f}× | ≤ {GOAL_STAGING}× {verdict(over <= GOAL_STAGING)} |")
        if over > GOAL_STAGING:
            notes.append(f"(c) ftrun stages in {over:.2f}× the time of a pinned non_blocking "
                         f"copy of the same tensors ({fmt_s(t_ft)} vs {fmt_s(t_ref)}); its time "
                         "includes hashing every byte on the host after the copy of its group.")
    else:
        rows.append(f"| (c) staging bandwidth into pre-faulted shm | {r.bw_ftrun:.2f} GB/s | "
                    f"{r.bw_plain:.2f} GB/s (torch copy_) | {frac:.3f} | ≥ {GOAL_BANDWIDTH} "
                    f"{verdict(frac >= GOAL_BANDWIDTH)} |")
    if frac < GOAL_BANDWIDTH and not r.cuda:
        notes.append(f"(c) ftrun stages at {frac:.2f} of the plain copy's bandwidth, "
                     f"{GOAL_BANDWIDTH - frac:.2f} below the goal. Its time includes hashing "
                     "every byte (xxh3 on hashing threads, overlapping the copy of the next "
                     "64 MiB group), which the plain copy does not do; on 2 cores the hashing "
                     "threads and the copy share the CPU and the memory bus.")

    # (d)
    if r.restore is not None and r.load is not None and r.restore.get("init_optim_state_s"):
        init = r.restore["init_optim_state_s"]
        notes.append(
            f"(d) (no goal) {fmt_s(init)} of restore()'s {fmt_s(r.restore_s)} is torch's "
            "_init_optim_state: get/set_optimizer_state_dict first run an AdamW step with zero "
            "gradients on the restarted rank's empty optimizer, whose state the snapshot then "
            f"replaces; without it restore() would take ≈ {fmt_s(r.restore_s - init)} vs "
            f"torch.load's {fmt_s(r.load_s)}.")
    if r.restore is not None and r.load is not None:
        ratio = r.restore_s / r.load_s
        rows.append(f"| (d) restore, fresh process: snap.restore() vs torch.load + "
                    f"load_state_dict | {fmt_s(r.restore_s)} | {fmt_s(r.load_s)} | "
                    f"{ratio:.3f}× | ≤ {GOAL_RESTORE}× {verdict(ratio <= GOAL_RESTORE)} |")
        if ratio > GOAL_RESTORE:
            notes.append(f"(d) restore() takes {ratio:.2f}× torch.load + load_state_dict "
                         f"({fmt_s(r.restore_s)} vs {fmt_s(r.load_s)}).")
    else:
        rows.append("| (d) restore | not measured | | | |")

    # (e)
    lengths = info.get("lengths")
    for part, run in r.lengths():
        step = med(run.none_s)
        times = step / lengths["copy_s"]
        long = times >= 2.5  # the goal holds from a step about 3x the copy on
        ok = run.throughput >= GOAL_THROUGHPUT
        goal = f"≥ {GOAL_THROUGHPUT} {verdict(ok)}" if long else "(none: step < 3× the copy)"
        rows.append(f"| (e) save() every step, {part['label']} step (batch {part['rows']}: "
                    f"{times:.1f}× the copy) | {fmt_s(med(run.snap_s))} | {fmt_s(step)} (no "
                    f"save) | throughput {run.throughput:.3f} | {goal} |")
        if long and not ok:
            notes.append(f"(e) at a step {times:.1f}× the copy ({fmt_s(step)}), a save every "
                         f"step costs {fmt_s(med(run.snap_s) - step)} a step: throughput "
                         f"{run.throughput:.3f}.")
    if lengths and lengths["fit"].get("capped"):
        notes.append(f"(e) the long step's batch hit --max-batch; its step is "
                     f"{lengths['fit']['points'][-1][1] / lengths['copy_s']:.1f}× the copy, "
                     "not 3×.")

    # (f)
    for part in (r.auto or {}).get("parts", []):
        ratio = auto_ratio(part)
        ok = ratio >= GOAL_THROUGHPUT
        rows.append(f"| (f) every=\"auto\", batch {part['rows']}: interval chosen "
                    f"{part['every']} | {fmt_s(statistics.fmean(part['auto_s']))} (mean) | "
                    f"{fmt_s(med(part['none_s']))} (no save, median) | throughput "
                    f"{ratio:.3f} | ≥ {GOAL_THROUGHPUT} {verdict(ok)} |")
        if not ok:
            notes.append(f"(f) under every=\"auto\" at batch {part['rows']} the interval "
                         f"settled at {part['every']} and throughput is {ratio:.3f}"
                         + (f"; {part['skipped']} save(s) skipped" if part["skipped"] else "")
                         + ".")

    _, inside, wait = a.blocking()
    lines = [
        f"## {HEADING}",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date (UTC): {meta['date']}",
        f"- Machine: {meta['host']}",
        f"- ftrun: commit {meta['tree']}; torch {info['torch']}; {info['threads']} intra-op "
        "threads per rank",
        f"- State: {info['blocks']} blocks × (LayerNorm, {info['dim']} → {4 * info['dim']} → "
        f"{info['dim']}), {info['params'] / 1e6:.1f} M params; params + AdamW exp_avg + "
        f"exp_avg_sq = {info['state_bytes'] / GIB:.3f} GiB ({info['state_bytes'] / 1e9:.2f} GB)."
        f" Step: forward, backward and AdamW on a batch of {info['batch']} × {info['dim']}; "
        + ("one rank (NCCL, world size 1) on the GPU, bf16 autocast, fused AdamW (fp32 state)."
           if r.cuda else "one rank (gloo, world size 1) on the CPU."),
        "- (a): under `ftrun --standalone --nproc-per-node 1`, its store verifying (hashing) "
        "every snapshot. Steps with and without save() finely interleaved in one process: save, "
        "save [counted: the previous save's copy and hash overlap it, its own save() is in it], "
        "untimed settle [copy staged and hashed], no save [counted]. Throughput ratio = median "
        f"over the {len(a.pair_ratios)} pairs of (step without / step with); the ratio of the "
        f"medians is {a.throughput_of_medians:.3f} (async) and {s.throughput_of_medians:.3f} "
        "(sync).",
        f"- (b): median over the counted saves ({len(inside)} for ftrun, {cfg.base_steps} each "
        "for the others, after warm-up saves); every method builds the same DCP state dicts "
        "(model + optimizer) in the timed part. DLRover (agent-less: its engine forks its own "
        "saver), torch.save and DCP (default thread executor; the wait for the previous save "
        "counts) under plain `torchrun --nproc-per-node 1`, same model and step.",
        "- (c): alternating, with nothing else running: ftrun's copy (its writer thread's time "
        "minus the claim round trip to the store; async_copy=False) and `copy_` of the same "
        + ("tensors, `non_blocking`, on a stream of its own, into one pinned host buffer "
           "(`pin_memory`, same 64-byte-aligned layout), timed with CUDA events; medians of "
           if r.cuda else "tensors into a pre-faulted `/dev/shm` file (same 64-byte-aligned "
           "layout); medians of ")
        + f"{len(s.doc['ref_copy_s'])}; {r.copy_bytes / 1e9:.2f} GB each.",
        "- (d): the rank exits on purpose after its last save; ftrun (`--max-restarts 2`) starts "
        "a fresh process that times `snap.restore()` (flush, hash check, clone out of shared "
        "memory, set_model/optimizer_state_dict), writes the same state with `torch.save` to "
        "`/dev/shm` and exits again; a second fresh process times `torch.load` + "
        "`model.load_state_dict` + `optimizer.load_state_dict` into an optimizer without state.",
        *lengths_lines(r, cfg),
        "",
        "| Part | ftrun | Reference | Ratio | Goal |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Details:",
        "",
    ]
    for run in (a, s):
        lines.append(
            f"- (a) {run.label}: step with save {fmt_s(med(run.snap_s))} (min "
            f"{fmt_s(min(run.snap_s))}, max {fmt_s(max(run.snap_s))}), without "
            f"{fmt_s(med(run.none_s))} (min {fmt_s(min(run.none_s))}, max "
            f"{fmt_s(max(run.none_s))}); per-pair ratios "
            + ", ".join(f"{x:.2f}" for x in run.pair_ratios) + ".")
    lines += [
        f"- (a) ftrun's work per snapshot, alone (untimed settle, async run): copy + hash "
        f"{fmt_s(med(a.doc['settle_s']))}; the store's check afterwards (sync run) "
        f"{fmt_s(med(s.doc['settle_s']))}"
        f". Copy overlapping forward/backward (async run): {fmt_s(med(a.training_copies()))}.",
        f"- (b) ftrun async: inside save() {fmt_s(med(inside))}, wait before optimizer.step() "
        f"{fmt_s(med(wait))} (max {fmt_s(max(wait))}). Median step with "
        + ", ".join(f"{k} {fmt_s(r.step_base(k))}" for k in BASELINES if k not in r.skipped)
        + f", without saving {fmt_s(r.step_base('none'))} (torchrun job).",
        f"- (c) ftrun copy {fmt_s(med(s.doc['ftrun_copy_s']))}, plain copy "
        f"{fmt_s(med(s.doc['ref_copy_s']))}; the same in the async job: ftrun "
        f"{gbps(r.copy_bytes, med(a.doc['ftrun_copy_s'])):.2f} GB/s, plain "
        f"{gbps(r.copy_bytes, med(a.doc['ref_copy_s'])):.2f} GB/s.",
    ]
    if r.restore is not None and r.load is not None:
        rs, ld = r.restore, r.load
        saved = a.doc.get("digest")
        same = rs["digest"] == saved and ld["digest"] == saved
        lines.append(
            f"- (d) restore() {fmt_s(rs['restore_s'])}: flush + hash check + clone "
            f"{fmt_s(rs.get('load_memory_s', float('nan')))} (hash check alone "
            f"{fmt_s(rs.get('verify_s', float('nan')))}), set_model/optimizer_state_dict "
            f"{fmt_s(rs.get('apply_s', float('nan')))} (of which torch's _init_optim_state, "
            "a throw-away optimizer step with zero gradients that get/set_optimizer_state_dict "
            "run on an optimizer without state: "
            f"{fmt_s(rs.get('init_optim_state_s', 0.0))}); restored step {rs['restored_step']} of "
            f"{a.doc['last_step']} from {rs['source']}. torch: load "
            f"{fmt_s(ld['torch_load_s'][0])} + apply "
            f"{fmt_s(ld['torch_load_apply_s'][0] - ld['torch_load_s'][0])}; again in the same "
            f"process: " + ", ".join(fmt_s(x) for x in ld["torch_load_apply_s"][1:]) + ". "
            + ("State digests after both restores equal the saved one." if same
               else "**State digests differ from the saved one.**"))
    if meta.get("dlrover_retries"):
        lines.append(f"- DLRover's agent-less saver process did not come up within its 60 s in "
                     f"{meta['dlrover_retries']} attempt(s) (`TimeoutError: Timed out waiting "
                     "for socket server`); the baselines' job was run again.")
    skipped = a.doc["skipped"] + s.doc["skipped"]
    if skipped:
        notes.append(f"ftrun skipped {skipped} save(s) (older buffer not yet committed).")
    lines.append("- Cores used by other processes (the machine is shared), per job: "
                 + "; ".join(meta["load"]) + ".")
    if meta["disturbed"]:
        lines.append("- **Disturbed**: other processes used more than "
                     f"{DISTURBED_CORES} of the 2 cores on average during "
                     + ", ".join(meta["disturbed"]) + "; those figures are less reliable.")
    if notes:
        lines += ["", "Goals not met, and where the time goes:", "", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n", notes


def lengths_lines(r: Results, cfg: argparse.Namespace) -> list[str]:
    """The method lines of (e) and (f), when they ran."""
    out = []
    lengths = r.a.doc.get("lengths")
    if lengths:
        fit = ", ".join(f"batch {rows}: {fmt_s(t)}" for rows, t in lengths["fit"]["points"])
        out.append(
            "- (e): async job, after (a): the reference copy of (c) first "
            f"({fmt_s(lengths['copy_s'])}, median of 3), then steps without save() at a few batch sizes ({fit}) to find a "
            f"step of about 3× the copy ({fmt_s(lengths['fit']['target_s'])}); then "
            f"{cfg.pair_steps} pairs as in (a) at batch {cfg.short_batch} (short) and at the "
            "fitted batch (long; none when the short step is that long already). The goal "
            "applies where the step is at least 2.5× the copy.")
    if r.auto:
        out.append(
            "- (f): a job of its own under ftrun, `Snapshotter(every=\"auto\")`, save() called "
            f"every step; per batch size: {cfg.auto_steps} steps without save(), two agreements "
            "on the interval (every 32 steps), then a whole number of intervals (at least "
            f"{cfg.auto_steps} steps) with save(), {cfg.auto_steps} steps without save() again; "
            "ratio = median step without / mean step with (the mean holds each snapshot's cost "
            "once per interval).")
    return out


def append_section(path: Path, run_text: str) -> None:
    """Append this run under HEADING: after the section's last run if it exists, else at the
    end of the file. Other sections are kept byte for byte (the file is re-read right here)."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == f"## {HEADING}"), None)
    if start is None:
        sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
        path.write_text(text + sep + run_text)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    body = run_text.split("\n", 2)[2]  # drop the heading line and the blank line after it
    stamp = body.split("\n", 2)[1].split(": ", 1)[-1]  # the date line
    block = f"\n### Run of {stamp}\n\n{body}"
    head = "".join(lines[:end]).rstrip("\n") + "\n"
    tail = "".join(lines[end:])
    path.write_text(head + block + ("\n" + tail if tail else ""))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def host_line(gpu: str | None = None) -> str:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln for ln in f if ln.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    where = f"GPU: {gpu}" if gpu else "CPU only (no GPU)"
    return (f"{os.cpu_count()} cores ({cpu}), {mem / GIB:.0f} GiB RAM, {where}, "
            f"Linux {platform.release()}, Python {platform.python_version()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0,
                   help="minimum params + Adam state in GiB (default 1.0)")
    p.add_argument("--steps", type=int, default=16,
                   help="counted steps per mode in (a) (default 16, at least 10)")
    p.add_argument("--base-steps", type=int, default=6,
                   help="counted saves per method in (b) for DLRover, torch.save, DCP (6)")
    p.add_argument("--batch", type=int, default=32, help="rows per batch (default 32)")
    p.add_argument("--dim", type=int, default=2048, help="model width (default 2048)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds before a launcher and its processes are killed")
    p.add_argument("--quiet-cores", type=float, default=0.5,
                   help="before each job, wait until other processes use fewer cores (0.5)")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="... but at most this many seconds per job (default 60)")
    p.add_argument("--dlrover-retries", type=int, default=1,
                   help="run the baselines' job again when DLRover's saver does not start (1)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="where the rank trains (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--short-batch", type=int, default=1,
                   help="rows per batch of the short step in (e) and (f) (default 1)")
    p.add_argument("--max-batch", type=int, default=1 << 16,
                   help="largest batch tried for the step ~3x the copy in (e) (65536)")
    p.add_argument("--pair-steps", type=int, default=8,
                   help="pairs per step length in (e) (default 8)")
    p.add_argument("--auto-steps", type=int, default=32,
                   help="steps without save() before and after, and at least as many with "
                   "save(), per batch size in (f) (default 32)")
    p.add_argument("--output", type=Path, help="append the Markdown section to this file")
    p.add_argument("--keep", action="store_true", help="keep logs and raw JSON (prints where)")
    return p.parse_args(argv)


def resolve_device(asked: str | None) -> str:
    """``asked``, or cuda when torch sees a GPU; a clear exit when cuda is asked for and there
    is none."""
    import torch

    available = torch.cuda.is_available()
    if asked == "cuda" and not available:
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        raise SystemExit(f"--device cuda: torch {torch.__version__} (built with {built}) sees "
                         "no CUDA device here; run on a machine with a GPU, or pass "
                         "--device cpu")
    return asked or ("cuda" if available else "cpu")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.steps < 1 or cfg.base_steps < 1:
        raise SystemExit("--steps and --base-steps must be >= 1")
    if cfg.short_batch < 1 or cfg.pair_steps < 1 or cfg.auto_steps < 1:
        raise SystemExit("--short-batch, --pair-steps and --auto-steps must be >= 1")
    cfg.device = resolve_device(cfg.device)
    for tool in ("ftrun", "torchrun"):
        if not (BIN / tool).exists():
            raise SystemExit(f"{BIN / tool} not found: run with the venv's python")
    tag = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="ftbench-snap-"))
    shm_dir = Path("/dev/shm") / f"ftbench-snap-{os.getuid()}-{tag}"
    shm_dir.mkdir(mode=0o700)
    sock_dir_existed = DLROVER_SOCK_DIR.exists()
    base_run_id = f"ftbench-snap-{tag}"
    meta: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/snapshot.py",
                                                      *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "host": host_line(),
        "tree": git_tree(),
    }
    env = {**os.environ, "FTRUN_SHM_DIR": str(shm_dir), "FTRUN_STATE_DIR": str(tmp / "state"),
           "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    common = ["--device", cfg.device, "--size-gib", str(cfg.size_gib), "--steps",
              str(cfg.steps), "--batch", str(cfg.batch), "--dim", str(cfg.dim), "--base-steps",
              str(cfg.base_steps), "--shm-dir", str(shm_dir)]
    ftrun = [str(BIN / "ftrun"), "--standalone", "--nproc-per-node", "1", "--max-restarts"]
    jobs = [
        Job("ftrun async_copy=True", [*ftrun, "2", str(WORKER), "--mode", "ftrun",
            "--async-copy", "1", "--restore", "--lengths", "--short-batch",
            str(cfg.short_batch), "--max-batch", str(cfg.max_batch), "--pair-steps",
            str(cfg.pair_steps), *common, "--result", str(tmp / "async.json")],
            env, tmp / "async.log", cfg.job_timeout),
        # Its batch sizes (--auto-batches) are the async job's short and long steps.
        Job("ftrun every=auto", [*ftrun, "0", str(WORKER), "--mode", "auto", "--auto-steps",
            str(cfg.auto_steps), *common, "--result", str(tmp / "auto.json")], env,
            tmp / "auto.log", cfg.job_timeout),
        Job("ftrun async_copy=False", [*ftrun, "0", str(WORKER), "--mode", "ftrun",
            "--async-copy", "0", *common, "--result", str(tmp / "sync.json")], env,
            tmp / "sync.log", cfg.job_timeout),
    ]

    def base_job(attempt: int) -> Job:
        # A new run id per attempt: DLRover names its sockets and segments after it.
        return Job("torchrun: DLRover, torch.save, DCP", [
            str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
            f"{base_run_id}-{attempt}", str(WORKER), "--mode", "baselines", *common,
            "--result", str(tmp / "base.json")], env, tmp / f"base-{attempt}.log",
            cfg.job_timeout)

    t_start = time.monotonic()
    failed = False
    loads: list[str] = []
    disturbed: list[str] = []
    meta["load"], meta["disturbed"] = loads, disturbed
    meta["dlrover_retries"] = 0
    try:
        attempt = 0
        while attempt < len(jobs) + 1:  # the ftrun jobs, then the baselines' (retried)
            job = jobs[attempt] if attempt < len(jobs) else base_job(meta["dlrover_retries"])
            attempt += 1
            before = wait_quiet(cfg.quiet_cores, cfg.quiet_wait)
            print(f"== {job.name}: {shlex.join(job.cmd[:6])} ... (other processes: "
                  f"{before:.2f} cores busy before)", flush=True)
            run_job(job)
            loads.append(f"{job.name.split(':')[0]} {before:.2f} before, "
                         f"{job.foreign_cores:.2f} during")
            if job.foreign_cores > DISTURBED_CORES:
                disturbed.append(f"{job.name} ({job.foreign_cores:.2f} cores)")
            print(f"   exit {job.rc} after {job.wall_s:.0f} s; other processes used "
                  f"{job.foreign_cores:.2f} cores meanwhile"
                  + (f"; killed leftover pids {job.stragglers}" if job.stragglers else ""),
                  flush=True)
            if job.rc != 0 and attempt > len(jobs) and dlrover_stuck(job.log) and \
                    meta["dlrover_retries"] < cfg.dlrover_retries:
                # DLRover's agent-less saver sometimes never answers (its engine then gives up
                # after 60 s): run the job again, and say so in the report.
                meta["dlrover_retries"] += 1
                attempt -= 1
                print("   DLRover's saver process did not start; trying the job again",
                      flush=True)
                continue
            if job.rc != 0:
                print(log_tail(job.log), file=sys.stderr)
                raise SystemExit(f"{job.name} failed (exit {job.rc}); log above")
            if job is jobs[0]:
                doc = load(tmp / "async.json")
                print_a(FtrunRun("async_copy=True", doc))
                print_d(maybe_load(tmp / "async.json.restore.json"),
                        maybe_load(tmp / "async.json.load.json"))
                print_e(doc)
                rows = sorted({p["rows"] for p in doc["lengths"]["parts"]})
                jobs[1].cmd += ["--auto-batches", *map(str, rows)]
            elif job is jobs[1]:
                print_f(load(tmp / "auto.json"))
            elif job is jobs[2]:
                print_a(FtrunRun("async_copy=False", load(tmp / "sync.json")))
                print_c(FtrunRun("async_copy=False", load(tmp / "sync.json")))
        r = Results(FtrunRun("async_copy=True", load(tmp / "async.json")),
                    FtrunRun("async_copy=False", load(tmp / "sync.json")),
                    load(tmp / "base.json"), maybe_load(tmp / "async.json.restore.json"),
                    maybe_load(tmp / "async.json.load.json"), load(tmp / "auto.json"))
        if r.cuda:
            meta["host"] = host_line(r.a.doc["device_name"])
        print_b(r)
        text, _ = report(cfg, r, meta)
        print()
        print(text)
        print(f"(total {time.monotonic() - t_start:.0f} s)")
        if cfg.output:
            append_section(cfg.output, text)
            print(f"appended to {cfg.output}")
    except BaseException:
        failed = True
        raise
    finally:
        leftovers = cleanup(shm_dir, base_run_id, sock_dir_existed)
        if leftovers:
            print(f"removed leftovers: {', '.join(leftovers)}")
        if cfg.keep or failed:
            print(f"logs and raw results kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def dlrover_stuck(log: Path) -> bool:
    try:
        return "Timed out waiting for socket server" in log.read_text(errors="replace")
    except OSError:
        return False


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def maybe_load(path: Path) -> dict[str, Any] | None:
    return load(path) if path.exists() else None


def cleanup(shm_dir: Path, run_id: str, sock_dir_existed: bool) -> list[str]:
    """Remove this run's shared memory and DLRover's sockets; returns what was removed."""
    removed = []
    if shm_dir.exists():
        n = sum(1 for _ in shm_dir.iterdir())
        shutil.rmtree(shm_dir, ignore_errors=True)
        if n:
            removed.append(f"{n} file(s) in {shm_dir}")
    for path in Path("/dev/shm").glob(f"{run_id}-*_ckpt_shm_*"):
        path.unlink(missing_ok=True)
        removed.append(str(path))
    for sock in DLROVER_SOCK_DIR.glob(f"{run_id}-*"):
        shutil.rmtree(sock, ignore_errors=True)
        removed.append(str(sock))
    if not sock_dir_existed:
        try:
            DLROVER_SOCK_DIR.rmdir()  # only when empty: someone else may use it by now
        except OSError:
            pass
    return removed


if __name__ == "__main__":
    sys.exit(main())
