"""Chaos run: one deterministic ftrun job suffers a seeded schedule of mixed faults.

One command::

    .venv/bin/python bench/chaos.py [--short] [--seed N] [--json FILE] [--output FILE]

The job is ``examples/train.py`` (a tiny model) on two launchers of two ranks each on
localhost (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous, gloo), snapshotting every step
and persisting every ``--persist-every`` steps to ``--persist-dir``. A schedule drawn from
``--seed`` (kind, rank or node, and step of every fault, spread over the run) hits it with:

- ``kill``, ``stop``, ``raise``, ``hang``: a rank SIGKILLs or SIGSTOPs itself, raises an
  exception out of its training loop or stops making progress, in the middle of its step
  (after backward);
- ``corrupt``: a rank flips a byte of its newest in-memory snapshot, then exits;
- ``store-kill``: the harness SIGKILLs one node's snapshot store process (the launcher
  restarts it; the store adopts the buffers);
- ``sigterm``: the harness SIGTERMs every launcher, waits for the job to end, and starts the
  same job again with the same command: it must resume from ``--persist-dir``;
- ``persist-corrupt``: right after a ``sigterm``, before the resume, the harness flips a byte
  inside a tensor of one rank's newest complete persisted step: the resume must refuse that
  step and load the older complete one.

The rank faults go to ``train.py --fault-schedule``; each fires once per job, recorded by its
marker file. The harness waits for each fault to fire and the job to recover before it moves
on, and it fires its own faults once rank 0 has completed the scheduled step. The same job
also runs fault-free; the run fails (exit 1) unless the faulted run ends with the fault-free
``params_xxh3``, every fault fired, the job recovered from each and resumed from the step
ftrun promises (see :func:`expected_resume`), the launchers exited as documented, and no
process or snapshot segment outlived the job.

For each fault the report gives the evidence that it fired (the marker file, or what the
harness did and saw), the step the job resumed from, the steps recomputed (the step in
progress when the fault hit minus the step resumed from), and the seconds from the fault to
the next step the job completed (rank 0's ``--step-log``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from ftrun.testing import (
    REPO as ROOT,
)
from ftrun.testing import (
    Launchers,
    cmdline,
    free_port,
    freeze_code,
    git_tree,
    parent_pid,
    pid_alive,
    read_jsonl,
    work_dir,
)

RANK_KINDS = ("kill", "stop", "raise", "hang", "corrupt")  # fired by train.py
STORE_KILL = "store-kill"
SIGTERM = "sigterm"
PERSIST_CORRUPT = "persist-corrupt"
KINDS = (*RANK_KINDS, STORE_KILL, SIGTERM, PERSIST_CORRUPT)
FROZEN = ("ftrun", "examples/train.py")
NODES, NPROC = 2, 2
WORLD = NODES * NPROC
MODEL = ("--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16", "--vocab", "64",
         "--batch", "8")
POLL_S = 0.1
HEADING = "Chaos run: one job, a seeded schedule of mixed faults"

T = TypeVar("T")


class ChaosError(Exception):
    """The run cannot go on (a fault never fired, the job did not recover or died)."""


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """The size of a chaos run."""

    name: str
    faults: int  # every kind at least once, the rest drawn at random
    max_sigterms: int  # whole-job restarts are the slow kind: at most this many
    gap: int  # steps from one fault's slot to the next (at least 3 apart)
    lead: int  # fault-free steps at the start and at the end


SHORT = Form("short", faults=len(KINDS), max_sigterms=1, gap=4, lead=4)
LONG = Form("long", faults=24, max_sigterms=3, gap=5, lead=4)


@dataclass
class Fault:
    """One scheduled fault and, once the run is over, what happened."""

    index: int
    kind: str
    step: int  # rank kinds: fires in this step; harness kinds: once rank 0 completed it
    rank: int | None = None  # rank kinds; persist-corrupt: whose persisted file is hit
    node: int | None = None  # store-kill: whose store
    # Filled in by the run.
    incarnation: int | None = None  # which ftrun invocation of the job it hit (0 = first)
    fired: bool = False
    evidence: str = ""
    fault_ts: float | None = None
    in_progress: int | None = None  # the step in progress when it hit
    detected_s: float | None = None  # to ftrun's worker_failure/hang_detected event
    next_step: int | None = None  # the next step the job completed after the fault
    to_next_step_s: float | None = None
    resumed_from: int | None = None  # None: the job did not restart (store-kill)
    expected: list[int] | None = None  # the steps ftrun may resume from (None: no restart)
    recomputed: int | None = None
    corrupted_step: int | None = None  # persist-corrupt: the persisted step hit
    detail: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        if self.kind == STORE_KILL:
            return f"node {self.node}"
        if self.rank is not None:
            return f"rank {self.rank}"
        return "job"


def build_schedule(form: Form, seed: int) -> tuple[list[Fault], int]:
    """Seeded schedule: every kind once, then random kinds; returns (faults by step, steps).

    Every kind but ``persist-corrupt`` takes a slot of ``form.gap`` steps, in a random order,
    at a random step inside its slot (consecutive faults at least 3 steps apart, so the job
    recovers from one before the next). A ``persist-corrupt`` rides on a ``sigterm``: it
    happens while the job is down.
    """
    rng = random.Random(seed)
    kinds = list(KINDS)
    while len(kinds) < form.faults:
        sigterms = kinds.count(SIGTERM)
        choices = [k for k in KINDS
                   if not (k == SIGTERM and sigterms >= form.max_sigterms)
                   # one per sigterm, and one sigterm (if there are two) stays plain
                   and not (k == PERSIST_CORRUPT
                            and kinds.count(PERSIST_CORRUPT) >= max(1, sigterms - 1))]
        kinds.append(rng.choice(choices))
    slots = [k for k in kinds if k != PERSIST_CORRUPT]
    rng.shuffle(slots)
    jitter = form.gap - 3
    faults: list[Fault] = []
    sigterm_steps = []
    for i, kind in enumerate(slots):
        step = form.lead + i * form.gap + rng.randint(0, jitter)
        f = Fault(0, kind, step)
        if kind in RANK_KINDS:
            f.rank = rng.randrange(WORLD)
        elif kind == STORE_KILL:
            f.node = rng.randrange(NODES)
        else:
            sigterm_steps.append(step)
        faults.append(f)
    for step in rng.sample(sigterm_steps, kinds.count(PERSIST_CORRUPT)):
        faults.append(Fault(0, PERSIST_CORRUPT, step, rank=rng.randrange(WORLD)))
    # A persist-corrupt comes right after the sigterm of its step.
    faults.sort(key=lambda f: (f.step, f.kind == PERSIST_CORRUPT))
    for i, f in enumerate(faults):
        f.index = i + 1
    steps = max(f.step for f in faults) + form.lead
    return faults, steps


def expected_resume(f: Fault, base: int, marker_corrupted: int | None = None,
                    store_killed_after: int | None = None) -> list[int]:
    """The steps ftrun may resume from after rank fault ``f``, in an incarnation that began at
    step ``base`` (what it resumed from; 0 for the first).

    A rank that fails in step S leaves every rank's snapshot of S-2 committed (a rank's save
    of S-1 overwrote its older buffer only once S-2 was committed), and normally S-1 too; a
    killed rank may die before its copy of S-1 completed. ``corrupt`` spoils the rank's own
    copy of its newest snapshot (S-1, after waiting for it): the restore reads that shard from
    its replica on the other node when the step was durable (the jobs run with the default
    ``--replicas 2``), else uses the step before it; the corrupt bytes are never loaded (the
    final weights say so). Steps not taken in this incarnation are only on disk: then the
    restore falls back to ``base``.

    After a store kill (``store_killed_after``: the step rank 0 had completed), until the next
    restart, a rank may keep its older buffer, and skip snapshots meanwhile, while the newest
    durable step is behind: replication to the restarted store resumes only once it serves,
    and a rank never overwrites its copy of the durable step for a newer snapshot whose
    replica is not placed yet. So the first fault after it may resume from any step since the
    one committed when the store died.
    """
    if f.kind == "corrupt":
        assert marker_corrupted is not None
        candidates = [marker_corrupted, marker_corrupted - 1]
    else:
        candidates = [f.step - 1, f.step - 2]
    if store_killed_after is not None:
        candidates += list(range(min(candidates) - 1, store_killed_after - 3, -1))
    inside = [s for s in candidates if s > base]
    return inside or [base]


# --------------------------------------------------------------------------------------------
# Persisted checkpoints (read independently of ftrun's own code)
# --------------------------------------------------------------------------------------------


def complete_steps(ckpt: Path) -> list[int]:
    """Steps of ``ckpt`` with a finished DCP directory for every rank, newest first."""
    out = []
    for d in ckpt.glob("step_*"):
        with contextlib.suppress(ValueError):
            step = int(d.name.removeprefix("step_"))
            ranks = {p.name for p in d.iterdir() if p.name.startswith("rank_")}
            if ranks == {f"rank_{r:05d}" for r in range(WORLD)} and all(
                    (d / f"rank_{r:05d}" / ".metadata").is_file() for r in range(WORLD)):
                out.append(step)
    return sorted(out, reverse=True)


def persisted_listing(ckpt: Path) -> str:
    parts = []
    for d in sorted(ckpt.glob("step_*")):
        ranks = sorted(p.name.removeprefix("rank_").lstrip("0") or "0" for p in d.iterdir()
                       if p.name.startswith("rank_"))
        parts.append(f"{int(d.name.removeprefix('step_'))}[{','.join(ranks)}]")
    return " ".join(parts) or "(empty)"


def flip_tensor_byte(rank_dir: Path, rng: random.Random) -> str:
    """Flip one byte inside the stored bytes of a model tensor of a DCP rank directory.

    The tensor's values are loaded with plain DCP and located in its storage file, so the byte
    hit is tensor data, not framing; the flip is checked by reading the byte back.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist load
    reader = dcp.FileSystemReader(str(rank_dir))
    meta = reader.read_metadata()
    keys = sorted(k for k, v in meta.state_dict_metadata.items()
                  if k.startswith(("model.", "model/")) and isinstance(v, TensorStorageMetadata)
                  and v.size.numel() >= 16)
    if not keys:
        raise ChaosError(f"{rank_dir} holds no model tensor to corrupt")
    key = rng.choice(keys)
    tmeta = meta.state_dict_metadata[key]
    assert isinstance(tmeta, TensorStorageMetadata)
    state = {key: torch.empty(tmeta.size, dtype=tmeta.properties.dtype)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(rank_dir)))
    raw = state[key].contiguous().view(torch.uint8).numpy().tobytes()
    infos = [(idx, info) for idx, info in meta.storage_data.items() if idx.fqn == key]
    if len(infos) != 1:
        raise ChaosError(f"{rank_dir}: {key} is stored in {len(infos)} pieces, expected 1")
    info = infos[0][1]
    path = rank_dir / info.relative_path
    with open(path, "r+b") as fh:
        fh.seek(info.offset)
        item = fh.read(info.length)
        at = item.find(raw)
        if at < 0 or item.find(raw, at + 1) >= 0:
            raise ChaosError(f"cannot locate the bytes of {key} in {path} (compressed?)")
        i = rng.randrange(len(raw))
        pos = info.offset + at + i
        fh.seek(pos)
        old = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([old ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())
        fh.seek(pos)
        new = fh.read(1)[0]
    if new != old ^ 0xFF:
        raise ChaosError(f"flipping byte {pos} of {path} did not stick")
    return (f"{path.relative_to(rank_dir.parent.parent)} byte {pos} "
            f"(byte {i} of {len(raw)} of {key}): {old:#04x} -> {new:#04x}")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclass
class Config:
    form: Form
    seed: int
    steps: int
    step_sleep_s: float
    hang_timeout_s: float
    persist_every: int
    slot_timeout_s: float
    exit_timeout_s: float


class Job:
    """The faulted (or the fault-free) job: its invocations, logs and files."""

    def __init__(self, cfg: Config, work: Path, code: Path, name: str,
                 schedule: list[Fault] | None) -> None:
        self.cfg = cfg
        self.work = work / name
        self.work.mkdir()
        self.code = code
        self.run_id = f"chaos-{name}-{os.getpid()}-{cfg.seed}"
        self.port = free_port()
        self.ckpt = self.work / "ckpt"
        self.faults_dir = self.work / "faults"
        self.steplog = self.work / "steps.jsonl"
        self.result = self.work / "result.json"
        self.state = self.work / "state"
        self.shm = Path("/dev/shm") / f"ftrun-chaos-{os.getpid()}-{name}"
        self.shm.mkdir(mode=0o700)
        # A snapshot every step: what expected_resume() assumes.
        train = [str(code / "examples" / "train.py"), "--steps", str(cfg.steps), *MODEL,
                 "--snapshot-every", "1", "--step-sleep", str(cfg.step_sleep_s), "--step-log", str(self.steplog),
                 "--fault-dir", str(self.faults_dir), "--result", str(self.result)]
        if schedule is not None:
            plan = [{"step": f.step, "rank": f.rank, "mode": f.kind}
                    for f in schedule if f.kind in RANK_KINDS]
            (self.work / "schedule.json").write_text(json.dumps(plan, indent=1) + "\n")
            train += ["--fault-schedule", str(self.work / "schedule.json")]
        self.cmd = [
            sys.executable, "-m", "ftrun", "--nnodes", str(NODES), "--nproc-per-node",
            str(NPROC), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", self.run_id, "--max-restarts", "100",
            "--hang-timeout", f"{cfg.hang_timeout_s:g}", "--persist-dir", str(self.ckpt),
            "--persist-every", str(cfg.persist_every), *train,
        ]
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(code),
                                                        os.environ.get("PYTHONPATH")])),
            "FTRUN_STATE_DIR": str(self.state),
            "FTRUN_SHM_DIR": str(self.shm),
        }
        self.env.pop("FTRUN_SECRET", None)
        self.invocations: list[Launchers] = []
        self.starts: list[float] = []
        self.bases: list[int] = []  # the step each invocation resumed from
        self.problems: list[str] = []

    # -- processes ---------------------------------------------------------------------------
    @property
    def current(self) -> Launchers:
        return self.invocations[-1]

    def start(self) -> None:
        """Start (or start again, after a sigterm) the job's launchers: the same command."""
        self.starts.append(time.time())
        self.invocations.append(Launchers(self.cmd, NODES, self.env, self.work,
                                          f"inv{len(self.invocations)}", self.code))

    def finish(self, timeout_s: float) -> None:
        """Wait for the current invocation to end by itself; it must succeed."""
        codes = self.current.wait(timeout_s)
        if any(c is None for c in codes):
            raise ChaosError(f"the job did not finish within {timeout_s:.0f} s\n"
                             + self.current.tail())
        if any(c != 0 for c in codes):
            raise ChaosError(f"the job failed: launcher exit codes {codes}\n"
                             + self.current.tail())
        self.reap("at the end")

    def reap(self, when: str) -> None:
        """Check that nothing of the ended invocation outlived it, and remove what did."""
        left = self.current.kill()
        if left:
            self.problems.append(f"{left} process(es) of the job outlived its launchers "
                                 f"({when}); killed")
        segs = sorted(p.name for p in self.shm.iterdir())
        if segs:
            self.problems.append(f"{len(segs)} snapshot segment(s) left after the launchers "
                                 f"exited ({when}): {', '.join(segs[:4])}; removed")
            for name in segs:
                with contextlib.suppress(OSError):
                    (self.shm / name).unlink()

    def cleanup(self) -> None:
        for inv in self.invocations:
            inv.kill()
        shutil.rmtree(self.shm, ignore_errors=True)

    # -- observation -------------------------------------------------------------------------
    def steps(self, since: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.steplog) if r["time"] > since]

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:
        path = self.state / "jobs" / self.run_id / "events.jsonl"
        return [e for e in read_jsonl(path) if e.get("ts", 0) >= since]

    def node_ids(self) -> dict[int, str]:
        """Node index -> ftrun's node id ("host/launcher pid") for the current invocation."""
        pids = self.current.pids
        out = {}
        for e in self.events(self.starts[-1]):
            if e["type"] == "node_joined" and e.get("pid") in pids:
                out[pids.index(e["pid"])] = e["node"]
        return out

    def wait(self, cond: Callable[[], T | None], what: str, timeout_s: float | None = None) -> T:
        """Poll ``cond`` until it returns something not None; the job must stay up meanwhile."""
        timeout_s = self.cfg.slot_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            value = cond()
            if value is not None:
                return value
            if not self.current.running():
                raise ChaosError(f"the job ended (exit codes {self.current.codes()}) while "
                                 f"waiting for {what}\n{self.current.tail()}")
            if time.monotonic() > deadline:
                raise ChaosError(f"timed out after {timeout_s:.0f} s waiting for {what}\n"
                                 + self.current.tail())
            time.sleep(POLL_S)

    def step_reached(self, step: int, since: float) -> dict[str, Any] | None:
        for r in self.steps(since):
            if r["step"] >= step:
                return r
        return None

    def first_step_after(self, t: float) -> dict[str, Any] | None:
        rows = self.steps(t)
        return rows[0] if rows else None


class ChaosRun:
    """Drives the faulted job through its schedule, one fault at a time."""

    def __init__(self, job: Job, faults: list[Fault], rng: random.Random) -> None:
        self.job = job
        self.faults = faults
        self.rng = rng
        self.slot_end = 0.0  # when the job had recovered from the previous fault
        self.store_killed_after: int | None = None  # a store kill since the last restart

    def run(self) -> None:
        job = self.job
        job.start()
        job.bases.append(0)
        i = 0
        while i < len(self.faults):
            f = self.faults[i]
            f.incarnation = len(job.invocations) - 1
            if f.kind in RANK_KINDS:
                self.rank_fault(f)
            elif f.kind == STORE_KILL:
                self.store_kill(f)
            else:
                riders = []
                while i + 1 < len(self.faults) and self.faults[i + 1].kind == PERSIST_CORRUPT:
                    i += 1
                    riders.append(self.faults[i])
                    self.faults[i].incarnation = f.incarnation
                self.sigterm(f, riders)
                self.store_killed_after = None  # a new invocation, new stores
            for done in (f, *(self.faults[j] for j in range(f.index, i + 1))):
                print(f"[chaos] {line_of(done)}", file=sys.stderr, flush=True)
            i += 1
        job.finish(self.job.cfg.slot_timeout_s + self.job.cfg.steps * 5)

    # -- rank faults -------------------------------------------------------------------------
    def rank_fault(self, f: Fault) -> None:
        job = self.job
        marker = job.faults_dir / f"fault-fired-rank{f.rank}-step{f.step}"

        def fired() -> list[dict[str, Any]] | None:
            lines = read_jsonl(marker)
            if not lines or (f.kind == "corrupt" and len(lines) < 2):
                return None
            return lines

        lines = job.wait(fired, f"the {f.kind} fault of rank {f.rank} in step {f.step}")
        info = lines[0]
        f.fired = info.get("mode") == f.kind and info.get("rank") == f.rank
        f.fault_ts = float(info["time"])
        f.in_progress = f.step
        f.evidence = f"marker {marker.name}: mode {info.get('mode')}, pid {info.get('pid')}"
        corrupted = None
        if f.kind == "corrupt":
            corrupted = int(lines[1]["corrupted_step"])
            f.evidence += f", corrupted its snapshot of step {corrupted}"
        if not f.fired:
            f.problems.append(f"the marker says {info}, not what was scheduled")
        t0 = f.fault_ts
        nodes = job.wait(lambda: ids if len(ids := job.node_ids()) == NODES else None,
                         "both nodes to have joined")

        def restarted() -> float | None:
            # Every node started new workers after the fault: the restarted world's first
            # step is the first completed after the later of those starts.
            first: dict[str, float] = {}
            for e in job.events(t0):
                if e["type"] == "workers_started" and e["node"] in nodes.values():
                    first.setdefault(e["node"], e["ts"])
            return max(first.values()) if len(first) == len(nodes) else None

        t_started = job.wait(restarted, f"both nodes to restart their workers after {f.kind}")
        nxt = job.wait(lambda: job.first_step_after(t_started),
                       f"the first step after the restart for {f.kind}")
        for e in job.events(t0):
            # (A stopped rank is killed by its launcher's own check, hang_detected, or on
            # the coordinator's order, stopped_rank_killed: whichever sees it first.)
            if e["type"] in ("worker_failure", "hang_detected", "stopped_rank_killed") \
                    and e.get("pid") == info["pid"]:
                f.detected_s = e["ts"] - t0
                f.detail = f"{e['type']}" + (f" ({e['reason']})" if e.get("reason") else
                                             f" ({e['why']})" if e.get("why") else
                                             f" (exit {e.get('exitcode')}, "
                                             f"signal {e.get('signal')})")
                break
        if f.detected_s is None:
            # The faulty rank's own failure may be seen second. All ranks stall behind a hung
            # one, and the launcher's progress check may kill those it sees first: the
            # in-place restart then aborts the hung rank, which leaves its function and keeps
            # its process. A rank on its way out (corrupt, raise) may lose the race to a peer
            # that saw its connections close: the in-place restart started for the peer
            # replaces it. Either way there is no failure of its pid to report, but the
            # restart that recovered from it names the rank.
            for e in job.events(t0):
                if e["type"] != "recovery" or e.get("how") != "in_process":
                    continue
                if f.kind == "hang" and info["rank"] in e.get("kept", []):
                    f.detail = f"aborted in place, kept its process ({e.get('why')})"
                elif info["rank"] in e.get("new_processes", []):
                    f.detail = f"replaced by the in-place restart ({e.get('why')})"
                else:
                    continue
                f.detected_s = e["ts"] - t0
                break
        if f.detected_s is None:
            f.problems.append(f"ftrun never reported the failure of pid {info['pid']}")
        self._recovered(f, nxt, expected_resume(f, job.bases[-1], corrupted,
                                                self.store_killed_after))
        self.store_killed_after = None  # the restart began a new epoch

    # -- harness faults ----------------------------------------------------------------------
    def store_kill(self, f: Fault) -> None:
        job = self.job
        job.wait(lambda: job.step_reached(f.step, self.slot_end),
                 f"rank 0 to complete step {f.step}")
        nodes = job.node_ids()
        node = nodes.get(f.node or 0)
        launcher = job.current.pids[f.node or 0]
        pid = None
        for e in job.events(job.starts[-1]):
            if e["type"] in ("store_started", "store_restarted") and e["node"] == node:
                pid = e["pid"]
        if pid is None or parent_pid(pid) != launcher or not any(
                "ftrun.store" in a for a in cmdline(pid)):
            raise ChaosError(f"cannot find node {f.node}'s store (event pid {pid}, launcher "
                             f"{launcher}, node {node})")
        f.in_progress = max(r["step"] for r in job.steps(job.starts[-1])) + 1
        f.fault_ts = time.time()
        os.kill(pid, signal.SIGKILL)
        f.fired = True
        self.store_killed_after = f.step
        f.evidence = f"SIGKILL to store pid {pid} (child of launcher {launcher})"
        t0 = f.fault_ts
        job.wait(lambda: None if pid_alive(pid) else True, f"store pid {pid} to die", 30)

        def back() -> dict[str, Any] | None:
            for e in job.events(t0):
                if e["type"] == "store_restarted" and e["node"] == node:
                    return e
            return None

        ev = job.wait(back, f"node {f.node}'s launcher to restart its store")
        f.detected_s = ev["ts"] - t0
        f.detail = f"store_restarted: pid {ev['pid']} after {f.detected_s:.2f} s"
        nxt = job.wait(lambda: job.first_step_after(t0), "the next step after the store kill")
        f.next_step = nxt["step"]
        f.to_next_step_s = nxt["time"] - t0
        # Training goes on with the new store, without a restart: the step after the one in
        # progress completes (before the next fault, which is at least 3 steps later).
        done = job.wait(lambda: job.step_reached(f.in_progress + 1, ev["ts"]),
                        "a full step after the store came back")
        restarts = [e for e in job.events(t0)
                    if e["type"] == "workers_started" and e["ts"] <= done["time"]]
        # Saves wait for the store: the longest time between two completed steps shows the
        # stall the kill caused.
        times = [t0] + [r["time"] for r in job.steps(t0) if r["time"] <= done["time"]]
        stall = max(b - a for a, b in zip(times, times[1:], strict=False))
        f.detail += f"; longest wait for a step after the kill: {stall:.2f} s"
        if restarts:
            f.problems.append(f"the store kill restarted the workers ({len(restarts)} "
                              "workers_started events)")
        self.slot_end = time.time()

    def sigterm(self, f: Fault, riders: list[Fault]) -> None:
        job, cfg = self.job, self.job.cfg
        job.wait(lambda: job.step_reached(f.step, self.slot_end),
                 f"rank 0 to complete step {f.step}")
        launchers = job.current
        f.fault_ts = time.time()
        launchers.signal(signal.SIGTERM)
        codes = launchers.wait(cfg.exit_timeout_s)
        t_down = time.time()
        f.fired = True
        f.evidence = (f"SIGTERM to launchers {launchers.pids}: exit codes {codes} after "
                      f"{t_down - f.fault_ts:.1f} s")
        if codes != [128 + signal.SIGTERM] * NODES:
            f.problems.append(f"launchers exited with {codes}, not {128 + signal.SIGTERM}")
        job.reap(f"after the SIGTERM of fault {f.index}")
        done = job.steps(job.starts[-1])
        f.in_progress = (max(r["step"] for r in done) if done else job.bases[-1]) + 1
        complete = complete_steps(job.ckpt)
        listing = persisted_listing(job.ckpt)
        f.detail = f"persisted steps[ranks] after exit: {listing}"
        expected = complete[:1] or [0]
        for rider in riders:
            rider.in_progress = f.in_progress
            if not complete:
                rider.problems.append("no complete persisted step to corrupt")
                continue
            step = complete[0]
            rank_dir = job.ckpt / f"step_{step:09d}" / f"rank_{rider.rank:05d}"
            rider.fault_ts = time.time()
            rider.corrupted_step = step
            rider.evidence = "flipped " + flip_tensor_byte(rank_dir, self.rng)
            rider.fired = True
            rider.detail = (f"newest complete step {step} corrupted; older complete: "
                            f"{complete[1:] or 'none'}")
            complete = complete[1:]
            expected = complete[:1] or [0]
        job.start()
        t_start = job.starts[-1]
        nxt = job.wait(lambda: job.first_step_after(t_start),
                       "the resumed job's first step")
        job.bases.append(nxt["step"] - 1)
        self._recovered(f, nxt, expected)
        for rider in riders:
            if rider.fired:
                self._recovered(rider, nxt, expected, slot=False)
                step = rider.corrupted_step
                names = (f"step {step}", f"step_{step:09d}")
                words = ("not loadable", "skipped", "mismatch", "refus", "corrupt")
                refusals = [ln.strip() for inv_log in job.current.logs
                            for ln in inv_log.read_text(errors="replace").splitlines()
                            if any(n in ln for n in names) and any(w in ln for w in words)]
                if refusals:
                    rider.detail += f"; resume said: {refusals[0][:240]}"
                else:
                    rider.problems.append(f"the resumed job's logs never say why step {step} "
                                          "was not used (a silent refusal)")

    # -- bookkeeping -------------------------------------------------------------------------
    def _recovered(self, f: Fault, nxt: dict[str, Any], expected: list[int],
                   slot: bool = True) -> None:
        assert f.fault_ts is not None and f.in_progress is not None
        f.next_step = nxt["step"]
        f.to_next_step_s = nxt["time"] - f.fault_ts
        f.resumed_from = nxt["step"] - 1
        f.expected = expected
        f.recomputed = f.in_progress - f.resumed_from
        if f.resumed_from not in expected:
            what = "a fresh start from step 0" if f.resumed_from == 0 else (
                f"step {f.resumed_from}")
            f.problems.append(f"resumed from {what}, expected "
                              f"{' or '.join(map(str, expected))}")
        if slot:
            self.slot_end = nxt["time"]


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def line_of(f: Fault) -> str:
    resumed = "—" if f.resumed_from is None else str(f.resumed_from)
    status = "ok" if f.fired and not f.problems else "PROBLEM: " + "; ".join(f.problems)
    return (f"#{f.index} {f.kind} {f.target} step {f.step}: fired={f.fired} resumed={resumed} "
            f"recomputed={f.recomputed} to-next-step={fmt_s(f.to_next_step_s)} s {status}")


def table(faults: list[Fault]) -> list[str]:
    out = [
        "| # | fault | target | step | fired (evidence) | detected after (s) | resumed from "
        "(expected) | recomputed | fault → next step (s) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in faults:
        if f.resumed_from is None:
            resumed = "— (no restart)" if f.kind == STORE_KILL else "—"
        else:
            resumed = f"{f.resumed_from} ({' or '.join(map(str, f.expected or []))})"
        notes = "; ".join([f.detail, *[f"**{p}**" for p in f.problems]]).strip("; ")
        out.append(
            f"| {f.index} | {f.kind} | {f.target} | {f.step} | "
            f"{'yes' if f.fired else '**no**'} ({f.evidence}) | {fmt_s(f.detected_s)} | "
            f"{resumed} | {'—' if f.recomputed is None else f.recomputed} | "
            f"{fmt_s(f.to_next_step_s)} | {notes.replace('|', '/')} |"
        )
    return out


def render(doc: dict[str, Any], faults: list[Fault]) -> str:
    cfg, run, clean = doc["config"], doc["faulted"], doc["fault_free"]
    kinds = {k: sum(1 for f in faults if f.kind == k) for k in KINDS}
    times = [f.to_next_step_s for f in faults if f.to_next_step_s is not None]
    lines = [
        f"## {HEADING}",
        "",
        f"- Command: `{doc['command']}`",
        f"- Date (UTC): {doc['date']}",
        f"- Host: {doc['host']}",
        f"- Code: commit {doc['code']}",
        f"- Job: `examples/train.py --steps {cfg['steps']} {' '.join(MODEL)} "
        f"--snapshot-every 1 --step-sleep "
        f"{cfg['step_sleep_s']:g}` on {NODES} launchers × {NPROC} ranks on localhost (gloo, "
        f"c10d rendezvous), `--hang-timeout {cfg['hang_timeout_s']:g} --persist-every "
        f"{cfg['persist_every']} --max-restarts 100`; seed {cfg['seed']}, {cfg['form']} form: "
        f"{len(faults)} faults ("
        + ", ".join(f"{n} {k}" for k, n in kinds.items() if n) + ").",
        f"- Result: faulted run {run['wall_s']:.0f} s in {run['invocations']} invocation(s), "
        f"{run['restarts']} worker restart(s); fault-free run {clean['wall_s']:.0f} s. "
        f"Final params_xxh3 `{run['params_xxh3']}` vs fault-free `{clean['params_xxh3']}`: "
        + ("**equal**." if run["params_xxh3"] == clean["params_xxh3"] else "**DIFFERENT**."),
    ]
    if times:
        lines.append(f"- Fault → next completed step: median {sorted(times)[len(times) // 2]:.2f}"
                     f" s, max {max(times):.2f} s; steps recomputed in total: "
                     f"{sum(f.recomputed or 0 for f in faults)}.")
    lines += [
        "",
        "\"resumed from\": the step before the first one rank 0 completed after the restart "
        "(expected: what ftrun promises, see `expected_resume` in bench/chaos.py); "
        "\"recomputed\": the step in progress when the fault hit minus the step resumed from; "
        "\"fault → next step\": from the fault (the marker's timestamp, or when the harness "
        "acted) to the next step rank 0 completed; \"detected after\": to ftrun's "
        "worker_failure/hang_detected event for the faulty pid (store-kill: to "
        "store_restarted).",
        "",
        *table(faults),
    ]
    problems = doc["problems"]
    lines += ["", "Problems: " + ("none." if not problems else "")]
    lines += [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Chaos run: one ftrun job (2 launchers x 2 ranks) suffers a seeded "
        "schedule of mixed faults and must end bit-identical to the fault-free run.")
    p.add_argument("--short", action="store_true",
                   help=f"one fault of each kind ({len(KINDS)}), for CI; default: the long "
                   f"form, {LONG.faults} faults")
    p.add_argument("--seed", type=int, default=1, help="schedule seed (default 1)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON to FILE")
    p.add_argument("--output", metavar="FILE",
                   help="also append the report (markdown, with command and date) to FILE")
    p.add_argument("--step-sleep", type=float, default=0.1,
                   help="train.py --step-sleep, seconds (default 0.1)")
    p.add_argument("--hang-timeout", type=float, default=10.0,
                   help="ftrun --hang-timeout, seconds (default 10: a store kill can stall "
                   "a snapshot save for up to 5 s, the rank's request timeout)")
    p.add_argument("--persist-every", type=int, default=2,
                   help="ftrun --persist-every (default 2)")
    p.add_argument("--slot-timeout", type=float, default=180.0,
                   help="give up when one fault has not fired or been recovered from after "
                   "this many seconds (default 180)")
    p.add_argument("--commit", metavar="REV",
                   help="run ftrun and examples/train.py as of commit REV (git archive) "
                   "instead of the working tree")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="work in DIR (created; must not exist) and keep it, instead of a "
                   "temporary directory")
    args = p.parse_args(argv)
    if args.step_sleep < 0 or args.hang_timeout <= 0 or args.persist_every < 1:
        p.error("--step-sleep must be >= 0, --hang-timeout > 0 and --persist-every >= 1")
    if args.commit and subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{args.commit}^{{commit}}"], cwd=ROOT,
            capture_output=True, timeout=30).returncode:
        p.error(f"--commit {args.commit}: no such commit in {ROOT}")
    if args.work_dir and Path(args.work_dir).exists():
        p.error(f"--work-dir {args.work_dir} exists already; name a directory to create")
    return args


def _on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every cleanup


def _host() -> str:
    import torch

    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"Linux {platform.machine()}, {os.cpu_count()} cores ({cpu}), CPU only, gloo; "
            f"load average (1 min) {os.getloadavg()[0]:.2f} at start; Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def run_clean(cfg: Config, work: Path, code: Path) -> dict[str, Any]:
    job = Job(cfg, work, code, "clean", None)
    try:
        t0 = time.time()
        job.start()
        job.finish(cfg.slot_timeout_s + cfg.steps * 5)
        doc = json.loads(job.result.read_text())
        return {"params_xxh3": doc["params_xxh3"], "wall_s": time.time() - t0,
                "problems": job.problems}
    finally:
        job.cleanup()


def run_faulted(cfg: Config, work: Path, code: Path, faults: list[Fault]) -> dict[str, Any]:
    job = Job(cfg, work, code, "faulted", faults)
    t0 = time.time()
    error = None
    try:
        ChaosRun(job, faults, random.Random(cfg.seed * 7919 + 1)).run()
    except ChaosError as e:
        error = str(e)
    finally:
        job.cleanup()
    restarts = sum(1 for e in job.events() if e["type"] == "workers_started") // NODES - len(
        job.invocations)
    digest = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        digest = json.loads(job.result.read_text())["params_xxh3"]
    return {"params_xxh3": digest, "wall_s": time.time() - t0,
            "invocations": len(job.invocations), "restarts": restarts,
            "resumed_from_per_invocation": job.bases, "problems": job.problems,
            "error": error}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    form = SHORT if args.short else LONG
    faults, steps = build_schedule(form, args.seed)
    cfg = Config(form, args.seed, steps, args.step_sleep, args.hang_timeout, args.persist_every,
                 args.slot_timeout, exit_timeout_s=120.0)
    print(f"[chaos] {form.name} form, seed {args.seed}, {steps} steps, {len(faults)} faults: "
          + ", ".join(f"{f.kind}@{f.step}" for f in faults), file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "version": 1,
        "command": shlex.join([os.path.relpath(sys.executable, ROOT)
                               if sys.executable.startswith(str(ROOT)) else sys.executable,
                               "bench/chaos.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": _host(),
        "code": git_tree(args.commit),
        "config": {"form": form.name, "seed": args.seed, "steps": steps,
                   "step_sleep_s": args.step_sleep, "hang_timeout_s": args.hang_timeout,
                   "persist_every": args.persist_every, "nodes": NODES,
                   "nproc_per_node": NPROC},
    }
    with work_dir("ftc-", args.keep, args.work_dir) as work:
        code = work / "code"
        digest = freeze_code(code, FROZEN, args.commit)
        doc["code"] += f"; run from a copy taken at start (sha256 {digest})"
        clean = run_clean(cfg, work, code)
        print(f"[chaos] fault-free: params_xxh3 {clean['params_xxh3']} in "
              f"{clean['wall_s']:.0f} s", file=sys.stderr, flush=True)
        faulted = run_faulted(cfg, work, code, faults)
    doc["fault_free"], doc["faulted"] = clean, faulted
    doc["faults"] = [{**asdict(f), "target": f.target} for f in faults]
    problems = [*(f"fault-free run: {p}" for p in clean["problems"]), *faulted["problems"]]
    if faulted["error"]:
        problems.append(f"the run stopped: {faulted['error'].splitlines()[0]}")
    for f in faults:
        if not f.fired:
            problems.append(f"fault #{f.index} ({f.kind} {f.target} step {f.step}) did not "
                            "fire")
        problems += [f"fault #{f.index} ({f.kind} {f.target} step {f.step}): {p}"
                     for p in f.problems]
    if faulted["params_xxh3"] != clean["params_xxh3"]:
        problems.append(f"final params_xxh3 {faulted['params_xxh3']} differs from the "
                        f"fault-free {clean['params_xxh3']}")
    doc["problems"] = problems
    doc["ok"] = not problems
    report = render(doc, faults)
    sys.stdout.write(report)
    if faulted["error"]:
        sys.stdout.write("\nThe run stopped early:\n" + faulted["error"] + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.output:
        out = Path(args.output)
        sep = "\n" if out.exists() and out.stat().st_size else ""
        with out.open("a") as fh:
            fh.write(sep + report)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
