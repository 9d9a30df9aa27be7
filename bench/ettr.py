"""Projection of effective training time (ETTR): ftrun against torchrun + periodic DCP saves.

    .venv/bin/python bench/ettr.py [--gpus 1024,2048,4096,8192,16384] [--runs 16] [--seed 0]
                                   [--trace FILE [--replay]] [--costs FILE] [--json]

A long synchronous training job on N GPUs (8 per node) meets faults drawn from a failure
trace; each launcher loses time to its checkpoints or snapshots, to detecting a fault, to
recovering from it, to recomputing the steps since the last usable save, and (ftrun) to its
persisted copy. ETTR = training time that survives / wall-clock time.

The trace, by default, is Llama 3's (Meta, "The Llama 3 Herd of Models", 2024, §3.3.4 and
Table 5): 16,384 H100 GPUs, 54 days, 466 interruptions, of which 47 planned and 419
unexpected, with the root causes counted below. The unexpected ones are drawn as Poisson
processes, one per cause, at the published count per GPU-second (so the rate scales linearly
with N); the 47 planned ones are left out (a save on purpose before them, the same for both
launchers). ``--trace FILE`` replaces it (JSON or CSV, see ``load_trace``): its events give
rates per fault kind in the same way, or with ``--replay`` are simulated as they are.

Every cost is in ``FIGURES``, one table, each with the section of bench/RESULTS.md it comes
from and whether it was measured on an H100, measured on CPU at small scale, composed from
measured parts, or assumed (with its source); ``--costs FILE`` (JSON: name -> number)
overrides any of them. The baseline checkpoints at the interval that maximises its own mean
ETTR over the same draws (searched; Young/Daly's sqrt(2·C·MTBF) is printed beside it); ftrun's
snapshot interval is searched the same way, and its shipped ``every="auto"`` rule (a snapshot
may cost 3% of the step time, and is taken no more often than Young's interval for the job's
failure rate, at most 60 s apart: ftrun/rank/cadence.py, with FTRUN_GPU_MTBF_HOURS at the
trace's rate) is shown beside it.

Deterministic under ``--seed``: run i at N GPUs draws from ``random.Random(f"{seed}:{N}:{i}")``.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import platform
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

GPUS_DEFAULT = (1024, 2048, 4096, 8192, 16384)
RUNS_DEFAULT = 16


class EttrError(Exception):
    """A bad trace or cost file, or a bad option: the message says what and how to fix it."""


# -- fault kinds and the default trace --------------------------------------------------------

RANK_CRASH = "rank_crash"  # a rank's process dies (or raises); the host is sound
HANG = "hang"  # a rank stops making progress (NCCL watchdog timeouts)
HOST_LOSS = "host_loss"  # hardware: the host must be isolated and a spare take its place
SLOW_RANK = "slow_rank"  # a rank runs slowly (throttling) until it is found and isolated
SILENT_CORRUPTION = "silent_corruption"  # wrong numbers without an error
KINDS = (RANK_CRASH, HANG, HOST_LOSS, SLOW_RANK, SILENT_CORRUPTION)
HOST_KINDS = (HOST_LOSS, SLOW_RANK)  # faults after which a host is replaced by a spare
SCOPES = {RANK_CRASH: ("rank", "host"), HANG: ("rank", "host"),
          HOST_LOSS: ("host", "link"), SLOW_RANK: ("rank", "host", "link"),
          SILENT_CORRUPTION: ("rank", "host")}

LLAMA3_SOURCE = ('Meta, "The Llama 3 Herd of Models" (arXiv:2407.21783, 2024), §3.3.4, '
                 "Table 5: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs")
LLAMA3_GPUS = 16384
LLAMA3_DAYS = 54.0
# (cause, count, share printed in the paper, fault kind). The counts sum to 419; the printed
# shares are count/419 except "Faulty GPU", printed as 30.1% (148/419 is 35.3%): the counts
# are what is drawn from.
LLAMA3_CAUSES: tuple[tuple[str, int, float, str], ...] = (
    ("Faulty GPU", 148, 30.1, HOST_LOSS),
    ("GPU HBM3 Memory", 72, 17.2, HOST_LOSS),
    ("Software Bug", 54, 12.9, RANK_CRASH),
    ("Network Switch/Cable", 35, 8.4, HOST_LOSS),
    ("Host Maintenance (unplanned)", 32, 7.6, HOST_LOSS),
    ("GPU SRAM Memory", 19, 4.5, HOST_LOSS),
    ("GPU System Processor", 17, 4.1, HOST_LOSS),
    ("NIC", 7, 1.7, HOST_LOSS),
    ("NCCL Watchdog Timeouts", 7, 1.7, HANG),
    ("Silent Data Corruption", 6, 1.4, SILENT_CORRUPTION),
    ("GPU Thermal Interface + Sensor", 6, 1.4, SLOW_RANK),
    ("SSD", 3, 0.7, HOST_LOSS),
    ("Power Supply", 3, 0.7, HOST_LOSS),
    ("Server Chassis", 2, 0.5, HOST_LOSS),
    ("IO Expansion Board", 2, 0.5, HOST_LOSS),
    ("Dependency", 2, 0.5, RANK_CRASH),
    ("CPU", 2, 0.5, HOST_LOSS),
    ("System Memory", 2, 0.5, HOST_LOSS),
)
MAPPING_NOTES = (
    "GPU, memory, NIC, power, chassis, SSD, CPU faults and unplanned host maintenance: "
    "host_loss (the host is isolated, a spare takes its place).",
    "Network switch/cable: host_loss (the host behind the link is cut off and isolated; a "
    "switch that takes several hosts down at once is not modelled).",
    "Software bug, dependency: rank_crash (the process dies; the host is sound).",
    "NCCL watchdog timeouts: hang. GPU thermal interface + sensor: slow_rank (a throttled GPU "
    "slows every step until it is found, then its host is isolated).",
    "Silent data corruption: silent_corruption (found by ftrun at the next snapshot's "
    "cross-replica hash check, issue 20 item 2; by the baseline from the loss curve).",
)


# -- costs ------------------------------------------------------------------------------------

MEASURED_H100 = "measured, 1 x H100 (NCCL, one GPU)"
MEASURED_CPU = "measured on CPU, small scale (2-core VM, gloo)"
COMPOSED = "composed from measured parts"
ASSUMED = "assumed"


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    status: str
    source: str


# One table of every cost: name, value, where it comes from. bench/RESULTS.md sections are
# named by their headings.
FIGURES: tuple[Figure, ...] = (
    Figure("state_gb_per_gpu", 3.22, "GB", MEASURED_H100,
           "RESULTS.md 'First GPU run: wave 2 on an H100': the snapshot bench's state (268.6 M "
           "params + AdamW) whose save costs below were measured; other sizes: override the "
           "save costs with it"),
    Figure("gpus_per_node", 8, "GPUs", ASSUMED, "H100 servers of 8 GPUs (Llama 3's cluster)"),
    # ftrun
    Figure("ftrun_snapshot_block_s", 0.1136, "s per snapshot", MEASURED_H100,
           "RESULTS.md 'First GPU run: wave 2 on an H100' (b): blocking per save, 3.22 GB, with "
           "8 ms steps (a longer step hides more of the copy)"),
    Figure("ftrun_auto_target", 0.03, "of step time", "ftrun's rule",
           "ftrun/rank/cadence.py Cadence.TARGET: every='auto' picks the shortest interval "
           "whose snapshot cost stays within 3% of the step time"),
    Figure("ftrun_auto_max_interval_s", 60.0, "s", "ftrun's rule",
           "ftrun/rank/cadence.py Cadence.MAX_INTERVAL_S: every='auto' lengthens the interval "
           "to Young's sqrt(2 * cost * MTBF) for the job's failure rate (FTRUN_GPU_MTBF_HOURS, "
           "here the trace's), at most this far apart"),
    Figure("ftrun_detect_rank_crash_s", 0.24, "s", MEASURED_CPU,
           "RESULTS.md 'Restart after a worker failure': ftrun detected a SIGKILL after 0.24 s"),
    Figure("ftrun_detect_hang_s", 3.4, "s", MEASURED_CPU,
           "RESULTS.md 'Detection: hangs found from the collectives...': hang named after "
           "3.4-3.5 s; 3.3 s among 4,096 simulated ranks"),
    Figure("ftrun_detect_host_loss_s", 6.6, "s", MEASURED_CPU,
           "RESULTS.md 'In-process restart on CPU, side by side': node loss on namespaces, "
           "total 6.6 s, all of it c10d's keep-alive expiry (2 s x 3)"),
    Figure("ftrun_detect_slow_rank_s", 15.0, "s", MEASURED_CPU,
           "RESULTS.md 'Detection: hangs found...': a rate-limited link localised to its host "
           "by probes 15 s after the limit was set"),
    Figure("ftrun_sdc_at_next_snapshot", 1, "1 = yes, 0 = no", ASSUMED,
           "issue 20 item 2 (cross-replica snapshot hash check, built on another branch): "
           "corruption found when the next snapshot commits; 0: found as the baseline finds it"),
    Figure("ftrun_in_process_s", 0.59, "s", MEASURED_H100,
           "RESULTS.md 'In-process restart on an H100 with NCCL': fault -> next step 0.59 s "
           "(abort, rendezvous, init_process_group, DDP, restore from shared memory)"),
    Figure("ftrun_worker_start_s", 3.26, "s", MEASURED_H100,
           "RESULTS.md 'First GPU run' group re-formation: a new process (interpreter, import "
           "torch, CUDA context, init_process_group + first all-reduce) 3264 ms"),
    Figure("ftrun_replica_fetch_gbps", 0.48, "GB/s", MEASURED_CPU,
           "RESULTS.md 'Replication to peer nodes' run 2 (a): ftrun replication on loopback "
           "0.48 GB/s (0.28-0.50 over both runs; CPU-bound Python, ~5 GB/s ceiling estimated "
           "per end on separate hosts)"),
    Figure("ftrun_replicas", 2, "copies", "ftrun setting",
           "--replicas 2: each node's snapshot also in one peer's memory (group placement)"),
    Figure("ftrun_ec_k", 4, "data fragments", "ftrun setting",
           "the third launcher row, --redundancy ec:K+M: groups of K + M nodes, each node's "
           "state cut into K slices, M parity fragments per stripe (ftrun.store.ec_store)"),
    Figure("ftrun_ec_m", 2, "parity fragments", "ftrun setting",
           "ec:4+2 holds 1.5x a node's state per node (replicas:2: 2x) and survives any 2 losses "
           "of a group; with M = 1 a second loss in the lost host's group during its recovery "
           "takes the memory copy"),
    Figure("ftrun_ec_rebuild_gbps", 0.077, "GB/s", MEASURED_CPU,
           "RESULTS.md 'Erasure coding': a lost node's 64 MB rebuilt and verified store to "
           "store in 0.83 s (bench/ec_store.py, ec:3+1, loopback; the ISA-L coder alone "
           "decodes at 0.5-1.0 GB/s through ftrun's path): the spare's shards are rebuilt, "
           "then fetched like a replica"),
    Figure("ftrun_persist_interval_s", 1800.0, "s", "ftrun setting",
           "--persist-interval: the store writes a snapshot to --persist-dir every 30 min"),
    Figure("ftrun_persist_block_s", 0.0, "s per persist", ASSUMED,
           "not measured: the store writes from shared memory, off the training thread"),
    # torchrun + torch.distributed.checkpoint
    Figure("base_save_block_s", 3.88, "s per save", MEASURED_H100,
           "RESULTS.md 'First GPU run: wave 2 on an H100' (b): DCP async_save, blocking part, "
           "3.22 GB"),
    Figure("base_cold_restart_s", 12.08, "s", MEASURED_H100,
           "RESULTS.md 'In-process restart on an H100 with NCCL': torchrun, fault (raise) -> "
           "next step 12.08 s: detection, new processes, imports, CUDA, NCCL, first step; no "
           "checkpoint load"),
    Figure("base_detect_hang_s", 600.0, "s", ASSUMED,
           "torch's default NCCL process-group timeout (10 min); RESULTS.md 'Detection' shows "
           "torchrun waiting it out"),
    Figure("base_detect_host_loss_s", 34.4, "s", ASSUMED,
           "NCCL's defaults: the survivors' transfers to the lost host fail after "
           "NCCL_IB_TIMEOUT=20 (4.096 us x 2^20 = 4.3 s) x (NCCL_IB_RETRY_CNT=7 + 1)"),
    Figure("base_spare_rendezvous_s", 30.0, "s", ASSUMED,
           "torchrun c10d rendezvous last_call_timeout default (30 s) before a round with a "
           "spare node closes"),
    Figure("base_detect_slow_rank_s", 3600.0, "s", ASSUMED,
           "no straggler detection in torchrun: an operator notices the throughput drop"),
    Figure("sdc_detect_s", 3600.0, "s", ASSUMED,
           "silent corruption found from the loss curve (issue 20: 'found today by loss "
           "spikes, days late'); the job rolls back to the last save before it"),
    # both
    Figure("slow_rank_speed", 0.5, "of full speed", ASSUMED,
           "the job's speed while a throttled GPU holds it back"),
    Figure("nccl_init_s_per_gpu", 0.0006, "s per GPU", ASSUMED,
           "forming the world's communicators at N GPUs, both launchers (ftrun re-forms them "
           "in place too): NVIDIA/nccl PR #1789 (Meta) reports 'several dozens of seconds at "
           "100K scale' -> ~60 s / 100,000 GPUs, linear in N (~9.8 s at 16,384)"),
    Figure("storage_gbps", 2000.0, "GB/s", ASSUMED,
           "Llama 3 paper §3.3.1: Tectonic sustains 2 TB/s (7 TB/s peak); every GPU writes and "
           "reads its state through it"),
    Figure("local_load_s", 2.20, "s", MEASURED_H100,
           "RESULTS.md 'First GPU run' (d): torch.load + load_state_dict of 3.22 GB in a fresh "
           "process, the floor of a checkpoint load"),
)
FIGURE_BY_NAME = {f.name: f for f in FIGURES}


def load_costs(path: str | Path | None) -> dict[str, float]:
    """The figures' values, with ``path``'s JSON object (name -> number) applied over them."""
    values = {f.name: float(f.value) for f in FIGURES}
    if path is None:
        return values
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise EttrError(f"--costs {path}: cannot read it ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise EttrError(f"--costs {path}: not JSON ({e}); write an object such as "
                        '{"base_cold_restart_s": 300}') from e
    if not isinstance(data, dict):
        raise EttrError(f"--costs {path}: expected a JSON object of name -> number, got "
                        f"{type(data).__name__}")
    for name, value in data.items():
        if name not in values:
            raise EttrError(f"--costs {path}: unknown figure {name!r}; known: "
                            f"{', '.join(sorted(values))}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise EttrError(f"--costs {path}: {name} must be a number >= 0, got {value!r}")
        values[name] = float(value)
    if values["ftrun_ec_k"] < 2:
        raise EttrError(f"--costs {path}: ftrun_ec_k must be >= 2 (ec:1+M is replicas), got "
                        f"{values['ftrun_ec_k']}")
    if values["slow_rank_speed"] > 1:
        raise EttrError(f"--costs {path}: slow_rank_speed is a fraction of full speed, "
                        f"0 to 1, got {values['slow_rank_speed']}")
    for name in ("ftrun_replica_fetch_gbps", "storage_gbps", "gpus_per_node",
                 "ftrun_auto_target", "ftrun_replicas", "ftrun_ec_rebuild_gbps", "ftrun_ec_m"):
        if values[name] <= 0:
            raise EttrError(f"--costs {path}: {name} must be > 0, got {values[name]}")
    return values


# -- the failure trace ------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """A fault at ``time_s``; ``u`` is a uniform draw that decides whether a host loss during
    another host's recovery hits the other copy of its snapshot (ftrun's memory lost)."""

    time_s: float
    kind: str
    scope: str = "rank"
    u: float = 1.0
    isolate: bool = False  # a slow rank's end: found, its host now isolated (internal)


@dataclass(frozen=True)
class Trace:
    """Fault counts per kind observed on ``gpus`` GPUs over ``duration_s``."""

    gpus: int
    duration_s: float
    counts: dict[str, int]
    source: str
    events: tuple[Event, ...] = ()  # the file's own events (``--replay``)

    def rate_per_s(self, kind: str, gpus: int) -> float:
        return self.counts.get(kind, 0) / self.duration_s * gpus / self.gpus

    def mtbf_s(self, gpus: int) -> float:
        total = sum(self.rate_per_s(k, gpus) for k in KINDS)
        return math.inf if total == 0 else 1.0 / total

    def draw(self, gpus: int, horizon_s: float, rng: random.Random) -> list[Event]:
        """Poisson arrivals of every kind at its rate scaled to ``gpus``, in time order."""
        rates = [self.rate_per_s(k, gpus) for k in KINDS]
        total = sum(rates)
        events: list[Event] = []
        if total == 0:
            return events
        t = rng.expovariate(total)
        while t < horizon_s:
            kind = rng.choices(KINDS, weights=rates)[0]
            events.append(Event(t, kind, SCOPES[kind][0], rng.random()))
            t += rng.expovariate(total)
        return events


def llama3_trace() -> Trace:
    counts = dict.fromkeys(KINDS, 0)
    for _, n, _, kind in LLAMA3_CAUSES:
        counts[kind] += n
    return Trace(LLAMA3_GPUS, LLAMA3_DAYS * 86400, counts, LLAMA3_SOURCE)


def _event(raw: dict[str, Any], where: str) -> Event:
    try:
        time_s = float(raw["time_s"])
        kind = str(raw["kind"]).strip()
    except KeyError as e:
        raise EttrError(f"{where}: missing field {e.args[0]!r} (each event needs time_s, "
                        f"kind and scope)") from e
    except (TypeError, ValueError) as e:
        raise EttrError(f"{where}: time_s must be a number of seconds, got "
                        f"{raw.get('time_s')!r}") from e
    if not (math.isfinite(time_s) and time_s >= 0):
        raise EttrError(f"{where}: time_s must be >= 0, got {time_s}")
    if kind not in KINDS:
        raise EttrError(f"{where}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    scope = str(raw.get("scope") or "").strip()
    if scope not in SCOPES[kind]:
        raise EttrError(f"{where}: scope {scope!r} does not fit kind {kind!r}; use one of "
                        f"{', '.join(SCOPES[kind])}")
    return Event(time_s, kind, scope)


def load_trace(path: str | Path, gpus: int | None = None,
               duration_s: float | None = None) -> Trace:
    """A trace file: JSON ``{"gpus": N, "duration_s": S, "events": [{"time_s", "kind",
    "scope"}, ...]}`` or CSV with a header ``time_s,kind,scope``. ``gpus``/``duration_s`` (the
    CLI's ``--trace-gpus``/``--trace-days``) are required for CSV and override the JSON's."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise EttrError(f"--trace {path}: cannot read it ({e.strerror})") from e
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = {}
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EttrError(f"--trace {path}: not JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("events"), list):
            raise EttrError(f"--trace {path}: expected an object with an 'events' list "
                            f"(and 'gpus', 'duration_s')")
        rows, meta = data["events"], data
        if not all(isinstance(r, dict) for r in rows):
            raise EttrError(f"--trace {path}: every event must be an object with time_s, "
                            f"kind and scope")
    elif p.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None or not {"time_s", "kind", "scope"} <= set(
                reader.fieldnames):
            raise EttrError(f"--trace {path}: the CSV needs a header line with time_s,kind,"
                            f"scope; found {reader.fieldnames}")
        rows = list(reader)
    else:
        raise EttrError(f"--trace {path}: name it .json or .csv so its format is known")
    events = tuple(sorted((_event(r, f"--trace {path}, event {i + 1}")
                           for i, r in enumerate(rows)), key=lambda e: e.time_s))
    n = gpus if gpus is not None else meta.get("gpus")
    if duration_s is None:
        duration_s = meta.get("duration_s")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise EttrError(f"--trace {path}: the number of GPUs it was observed on is missing "
                        f"or not a positive integer ({n!r}); give 'gpus' in the JSON or "
                        f"--trace-gpus")
    try:
        duration = float(duration_s)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise EttrError(f"--trace {path}: its duration is missing or not a number "
                        f"({duration_s!r}); give 'duration_s' in the JSON or --trace-days") from e
    if not duration > 0:
        raise EttrError(f"--trace {path}: duration must be > 0 s, got {duration}")
    late = [e for e in events if e.time_s >= duration]
    if late:
        raise EttrError(f"--trace {path}: {len(late)} event(s) at or after the trace's end "
                        f"({duration} s), the first at {late[0].time_s} s")
    counts = dict.fromkeys(KINDS, 0)
    for e in events:
        counts[e.kind] += 1
    return Trace(n, duration, counts, f"trace file {path}: {len(events)} events", events)


# -- one launcher's behaviour -----------------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    """How a launcher spends time: saves every ``interval_s`` of training, each blocking
    ``save_block_s`` and restorable ``save_lag_s`` after it ends; per fault kind, seconds to
    detect and to recover. ``detect_s[kind] = None``: found when the next save completes.
    With ``persist_every`` k > 0, every k-th save is also persisted (blocking
    ``persist_block_s`` more, restorable ``persist_lag_s`` after), the copy used when a host
    loss during another host's recovery takes the last in-memory copy (probability
    ``memory_lost_p``), at ``disk_restore_s`` more recovery."""

    name: str
    interval_s: float
    save_block_s: float
    save_lag_s: float
    detect_s: dict[str, float | None]
    recover_s: dict[str, float]
    persist_every: int = 0
    persist_block_s: float = 0.0
    persist_lag_s: float = 0.0
    memory_lost_p: float = 0.0
    disk_restore_s: float = 0.0
    slow_speed: float = 0.5

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise EttrError(f"{self.name}: the save interval must be > 0 s, got "
                            f"{self.interval_s}")
        if not 0 <= self.slow_speed <= 1:
            raise EttrError(f"{self.name}: slow_speed must be within 0..1, got "
                            f"{self.slow_speed}")

    # A run phase is a sequence of cycles (interval_s of training, then save_block_s), every
    # k-th followed by persist_block_s: a supercycle of length L.
    def _shape(self) -> tuple[float, int, float]:
        k = self.persist_every or 1
        cycle = self.interval_s + self.save_block_s
        return cycle, k, k * cycle + (self.persist_block_s if self.persist_every else 0.0)

    def work(self, e: float) -> float:
        """Training seconds done ``e`` seconds into a run phase."""
        cycle, k, length = self._shape()
        q, r = divmod(e, length)
        n = min(k, int(r // cycle))
        rem = r - n * cycle
        return q * k * self.interval_s + n * self.interval_s + (
            min(rem, self.interval_s) if n < k else 0.0)

    def persist_time(self, e: float) -> float:
        """Seconds of persist blocks within the first ``e`` seconds of a run phase."""
        if not self.persist_every:
            return 0.0
        cycle, k, length = self._shape()
        q, r = divmod(e, length)
        return q * self.persist_block_s + max(0.0, r - k * cycle)

    def saves_done(self, x: float) -> int:
        """Saves completed within the first ``x`` seconds of a run phase."""
        if x < 0:
            return 0
        cycle, k, length = self._shape()
        q, r = divmod(x, length)
        return int(q) * k + min(k, int(r // cycle))

    def persists_done(self, x: float) -> int:
        if not self.persist_every or x < 0:
            return 0
        return int(x // self._shape()[2])

    def next_save_end(self, e: float) -> float:
        """When (within the run phase) the first save that ends after ``e`` ends."""
        cycle, k, length = self._shape()
        j = self.saves_done(e) + 1
        q, n = divmod(j - 1, k)
        return q * length + (n + 1) * cycle


LOSSES = ("checkpoint", "detection", "recovery", "recompute", "persist")


@dataclass
class Outcome:
    """Where the wall time of one simulated job went (seconds)."""

    horizon_s: float
    useful: float = 0.0
    checkpoint: float = 0.0
    detection: float = 0.0
    recovery: float = 0.0
    recompute: float = 0.0
    persist: float = 0.0
    faults: int = 0
    memory_lost: int = 0

    @property
    def ettr(self) -> float:
        return self.useful / self.horizon_s


def simulate(events: Iterable[Event], policy: Policy, horizon_s: float) -> Outcome:
    """Run one job of ``horizon_s`` wall seconds through ``events`` under ``policy``.

    Faults stop the run at once (a slow rank first slows it: a stall of (1 - speed) of its
    detection time, then the stop when it is found); the job restores from the newest save
    restorable at that moment and everything trained after it is recomputed. A fault during
    a recovery starts the recovery over from that fault. Training done by the end of the
    horizon counts as useful."""
    out = Outcome(horizon_s)
    queue = [(e.time_s, i, e) for i, e in enumerate(events) if e.time_s < horizon_s]
    heapq.heapify(queue)
    seq = len(queue)
    running, run_start = True, 0.0
    restored = 0.0  # training seconds the current run phase started from
    persisted = 0.0  # training seconds of the newest persisted copy
    down_start = down_det = down_rec = down_pers = 0.0
    down_kind = ""
    from_disk = False  # the current recovery restores the persisted copy

    def close_down(until: float) -> None:
        spent = until - down_start
        det = min(spent, down_det)
        rest = spent - det
        rec = min(rest, down_rec)
        out.detection += det
        out.recovery += rec
        out.persist += min(rest - rec, down_pers)

    def resume_by(t: float) -> None:
        nonlocal running, run_start, from_disk
        end = down_start + down_det + down_rec + down_pers
        if not running and t >= end:
            close_down(end)
            running, run_start, from_disk = True, end, False

    while queue:
        t, _, ev = heapq.heappop(queue)
        resume_by(t)
        detect = policy.detect_s[ev.kind]
        if running and ev.kind == SLOW_RANK and not ev.isolate:
            assert detect is not None
            stall = (1.0 - policy.slow_speed) * detect
            out.faults += 1
            out.detection += stall
            run_start += stall  # the run phase's clock is training time: it stands still
            if t + detect < horizon_s:
                heapq.heappush(queue, (t + detect, seq, replace(ev, isolate=True)))
                seq += 1
            continue
        if not ev.isolate:
            out.faults += 1
        if ev.isolate:
            detect = 0.0
        if running:
            e = t - run_start
            done = policy.work(e)
            blocked = e - done
            pers = policy.persist_time(e)
            out.checkpoint += blocked - pers
            out.persist += pers
            usable = restored + policy.saves_done(e - policy.save_lag_s) * policy.interval_s
            if policy.persist_every:
                n = policy.persists_done(e - policy.persist_lag_s)
                if n:
                    persisted = max(persisted,
                                    restored + n * policy.persist_every * policy.interval_s)
            else:
                persisted = usable
            out.recompute += restored + done - usable
            restored = usable
            if detect is None:  # found when the next save completes
                detect = policy.next_save_end(e) - e
        else:
            close_down(t)
            if detect is None:
                detect = policy.interval_s + policy.save_block_s
            if (ev.kind in HOST_KINDS and down_kind in HOST_KINDS
                    and ev.u < policy.memory_lost_p):
                out.memory_lost += 1
                out.recompute += restored - persisted
                restored = persisted
                from_disk = True
        running = False
        down_start, down_kind = t, ev.kind
        down_det, down_rec = detect, policy.recover_s[ev.kind]
        down_pers = policy.disk_restore_s if from_disk else 0.0
    resume_by(horizon_s)
    if running:
        e = horizon_s - run_start
        done = policy.work(e)
        pers = policy.persist_time(e)
        out.checkpoint += e - done - pers
        out.persist += pers
        out.useful = restored + done
    else:
        close_down(horizon_s)
        out.useful = restored
    return out


# -- the two launchers at N GPUs --------------------------------------------------------------

def nccl_init_s(c: dict[str, float], gpus: int) -> float:
    return c["nccl_init_s_per_gpu"] * gpus


def storage_s(c: dict[str, float], gpus: int) -> float:
    """Seconds for every GPU's state to go through the shared storage, one way."""
    return gpus * c["state_gb_per_gpu"] / c["storage_gbps"]


def checkpoint_load_s(c: dict[str, float], gpus: int) -> float:
    return max(c["local_load_s"], storage_s(c, gpus))


def ftrun_recovery(c: dict[str, float], gpus: int, ec: bool = False) -> dict[str, float]:
    """ftrun's recovery per kind: the world re-forms in place (every rank keeps its process
    and restores from shared memory); a dead or hung rank gets a new process; a lost host's
    spare starts its workers and fetches the host's snapshot from the peer holding its copy
    (``ec``: from the survivor that rebuilt it from its group's slices and parity first)."""
    in_place = c["ftrun_in_process_s"] + nccl_init_s(c, gpus)
    new_rank = c["ftrun_worker_start_s"] + in_place
    node_gb = c["gpus_per_node"] * c["state_gb_per_gpu"]
    fetch = node_gb / c["ftrun_replica_fetch_gbps"]
    if ec:
        fetch += node_gb / c["ftrun_ec_rebuild_gbps"]
    new_host = c["ftrun_worker_start_s"] + fetch + in_place
    return {RANK_CRASH: new_rank, HANG: new_rank, HOST_LOSS: new_host, SLOW_RANK: new_host,
            SILENT_CORRUPTION: in_place}


def ftrun_policy(c: dict[str, float], gpus: int, interval_s: float, ec: bool = False) -> Policy:
    """ftrun with ``--replicas`` (ftrun_replicas), or with ``ec``: ``--redundancy
    ec:K+M`` (ftrun_ec_k, ftrun_ec_m)."""
    nodes = gpus / c["gpus_per_node"]
    cycle = interval_s + c["ftrun_snapshot_block_s"]
    every = max(1, round(c["ftrun_persist_interval_s"] / cycle)) \
        if c["ftrun_persist_interval_s"] > 0 else 0
    # With two copies, a second host lost during a host's recovery takes the last copy of the
    # first one's snapshot if it is the peer holding it; with three or more, one cannot.
    lost_p = (1.0 / (nodes - 1) if nodes > 1 else 1.0) if c["ftrun_replicas"] < 3 else 0.0
    name = "ftrun"
    if ec:
        # Under ec:K+1 any other node of the lost host's group (K of them) lost during its
        # recovery leaves a stripe short of K pieces; M >= 2 survives a second loss.
        k, m = int(c["ftrun_ec_k"]), int(c["ftrun_ec_m"])
        lost_p = min(1.0, k / (nodes - 1)) if m < 2 and nodes > 1 else 0.0 if m >= 2 else 1.0
        name = f"ftrun, ec:{k}+{m}"
    return Policy(
        name, interval_s, c["ftrun_snapshot_block_s"], 0.0,
        detect_s={RANK_CRASH: c["ftrun_detect_rank_crash_s"], HANG: c["ftrun_detect_hang_s"],
                  HOST_LOSS: c["ftrun_detect_host_loss_s"],
                  SLOW_RANK: c["ftrun_detect_slow_rank_s"],
                  SILENT_CORRUPTION: None if c["ftrun_sdc_at_next_snapshot"] else
                  c["sdc_detect_s"]},
        recover_s=ftrun_recovery(c, gpus, ec),
        persist_every=every, persist_block_s=c["ftrun_persist_block_s"],
        persist_lag_s=storage_s(c, gpus) if every else 0.0,
        memory_lost_p=lost_p if every else 0.0,
        disk_restore_s=checkpoint_load_s(c, gpus),
        slow_speed=c["slow_rank_speed"])


def baseline_recovery(c: dict[str, float], gpus: int) -> dict[str, float]:
    """torchrun's recovery: every rank a new process (the measured cold restart), the world's
    communicators formed anew, the last checkpoint loaded from storage; a lost host waits
    for the rendezvous round that takes the spare in."""
    restart = c["base_cold_restart_s"] + nccl_init_s(c, gpus) + checkpoint_load_s(c, gpus)
    spare = c["base_spare_rendezvous_s"] + restart
    return {RANK_CRASH: restart, HANG: restart, HOST_LOSS: spare, SLOW_RANK: spare,
            SILENT_CORRUPTION: restart}


def baseline_policy(c: dict[str, float], gpus: int, interval_s: float) -> Policy:
    return Policy(
        "torchrun + DCP", interval_s, c["base_save_block_s"], storage_s(c, gpus),
        # a crash's detection is inside the measured cold restart (it runs from the fault)
        detect_s={RANK_CRASH: 0.0, HANG: c["base_detect_hang_s"],
                  HOST_LOSS: c["base_detect_host_loss_s"],
                  SLOW_RANK: c["base_detect_slow_rank_s"],
                  SILENT_CORRUPTION: c["sdc_detect_s"]},
        recover_s=baseline_recovery(c, gpus), slow_speed=c["slow_rank_speed"])


# -- the interval search and the Monte Carlo --------------------------------------------------

PolicyAt = Callable[[float], Policy]


def mean_ettr(draws: Sequence[Sequence[Event]], policy: Policy, horizon_s: float) -> float:
    return statistics.fmean(simulate(d, policy, horizon_s).ettr for d in draws)


def best_interval(draws: Sequence[Sequence[Event]], policy_at: PolicyAt, horizon_s: float,
                  lo_s: float = 1.0, hi_s: float = 86400.0) -> float:
    """The save interval with the highest mean ETTR over ``draws`` (the same draws for every
    interval): a geometric grid, then a golden-section search around its best point."""
    memo: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in memo:
            memo[x] = mean_ettr(draws, policy_at(x), horizon_s)
        return memo[x]

    n = 29
    grid = [lo_s * (hi_s / lo_s) ** (i / (n - 1)) for i in range(n)]
    i = max(range(n), key=lambda j: f(grid[j]))
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, n - 1)])
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(24):
        if f(math.exp(c)) >= f(math.exp(d)):
            b, d = d, c
            c = b - g * (b - a)
        else:
            a, c = c, d
            d = a + g * (b - a)
    return max(memo, key=lambda x: (memo[x], -x))


def young_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_s(save_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher-order estimate of the optimum compute time between saves."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


@dataclass
class Summary:
    """One launcher at one size: ETTR over the runs and the mean share of each loss."""

    name: str
    interval_s: float
    ettrs: list[float]
    losses: dict[str, float]
    faults: float
    memory_lost: int
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ettrs)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.ettrs) if len(self.ettrs) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "interval_s": self.interval_s, "ettr_mean": self.mean,
                "ettr_sd": self.sd, "ettr_min": min(self.ettrs), "ettr_max": max(self.ettrs),
                "loss_fraction": self.losses, "faults_mean": self.faults,
                "memory_lost_runs": self.memory_lost, **self.extra}


def summarize(draws: Sequence[Sequence[Event]], policy: Policy, horizon_s: float,
              **extra: float) -> Summary:
    outs = [simulate(d, policy, horizon_s) for d in draws]
    losses = {k: statistics.fmean(getattr(o, k) for o in outs) / horizon_s for k in LOSSES}
    return Summary(policy.name, policy.interval_s, [o.ettr for o in outs], losses,
                   statistics.fmean(o.faults for o in outs),
                   sum(1 for o in outs if o.memory_lost), dict(extra))


@dataclass
class SizeResult:
    gpus: int
    mtbf_s: float
    ftrun: Summary
    ftrun_auto: Summary
    baseline: Summary
    ftrun_ec: Summary

    def as_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "mtbf_s": self.mtbf_s, "ftrun": self.ftrun.as_dict(),
                "ftrun_auto": self.ftrun_auto.as_dict(), "baseline": self.baseline.as_dict(),
                "ftrun_ec": self.ftrun_ec.as_dict()}


def project(trace: Trace, costs: dict[str, float], gpus: int, runs: int, seed: int,
            horizon_s: float) -> SizeResult:
    draws = [trace.draw(gpus, horizon_s, random.Random(f"{seed}:{gpus}:{i}"))
             for i in range(runs)]
    return project_draws(trace.mtbf_s(gpus), costs, gpus, draws, horizon_s)


def auto_interval_s(costs: dict[str, float], mtbf_s: float) -> float:
    """Training time between snapshots under every='auto' (ftrun/rank/cadence.py): the
    shortest interval whose snapshot costs at most the target share, or Young's interval
    for a job that fails every ``mtbf_s`` on average, capped, whichever is longer."""
    block = costs["ftrun_snapshot_block_s"]
    young = min(costs["ftrun_auto_max_interval_s"], math.sqrt(2.0 * block * mtbf_s))
    return max(block / costs["ftrun_auto_target"], young)


def project_draws(mtbf_s: float, costs: dict[str, float], gpus: int,
                  draws: Sequence[Sequence[Event]], horizon_s: float) -> SizeResult:
    def ftrun_at(x: float) -> Policy:
        return ftrun_policy(costs, gpus, x)

    def base_at(x: float) -> Policy:
        return baseline_policy(costs, gpus, x)

    def ec_at(x: float) -> Policy:
        return ftrun_policy(costs, gpus, x, ec=True)

    f_int = best_interval(draws, ftrun_at, horizon_s)
    b_int = best_interval(draws, base_at, horizon_s)
    e_int = best_interval(draws, ec_at, horizon_s)
    auto_int = auto_interval_s(costs, mtbf_s)
    c = costs["base_save_block_s"]
    return SizeResult(
        gpus, mtbf_s,
        summarize(draws, ftrun_at(f_int), horizon_s),
        summarize(draws, replace(ftrun_at(auto_int), name="ftrun, every=auto"), horizon_s),
        summarize(draws, base_at(b_int), horizon_s, young_s=young_s(c, mtbf_s),
                  daly_s=daly_s(c, mtbf_s)),
        summarize(draws, ec_at(e_int), horizon_s))


# -- report -----------------------------------------------------------------------------------

def _dur(s: float) -> str:
    if math.isinf(s):
        return "inf"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _ettr(s: Summary) -> str:
    return f"{s.mean:.4f} ± {s.sd:.4f} ({min(s.ettrs):.4f}-{max(s.ettrs):.4f})"


def decides(r: SizeResult) -> list[str]:
    """Sentences naming the costs that decide the gap at this size, from the numbers."""
    f, b = r.ftrun, r.baseline
    diff = {k: b.losses[k] - f.losses[k] for k in LOSSES}
    top = max(LOSSES, key=lambda k: abs(diff[k]))
    ranked = sorted(LOSSES, key=lambda k: -f.losses[k])
    lines = [
        f"At {r.gpus:,} GPUs ftrun's projected ETTR is {f.mean:.4f} against the baseline's "
        f"{b.mean:.4f} (+{f.mean - b.mean:.4f}); the largest difference is {top} "
        f"({_pct(b.losses[top])} of the wall time against {_pct(f.losses[top])}), then "
        + ", ".join(f"{k} ({_pct(diff[k])})" for k in sorted(
            (k for k in LOSSES if k != top), key=lambda k: -abs(diff[k]))[:2]) + ".",
        "ftrun's own losses, largest first: " + ", ".join(
            f"{k} {_pct(f.losses[k])}" for k in ranked) + ".",
        f"Goal ETTR >= 0.98 at {r.gpus:,} GPUs: ftrun with its snapshot interval searched "
        f"({_dur(f.interval_s)}): {'met' if f.mean >= 0.98 else 'NOT met'} ({f.mean:.4f}); "
        f"with every='auto' as shipped (interval {_dur(r.ftrun_auto.interval_s)}, "
        f"snapshots {_pct(r.ftrun_auto.losses['checkpoint'])} of the time): "
        f"{'met' if r.ftrun_auto.mean >= 0.98 else 'NOT met'} ({r.ftrun_auto.mean:.4f}).",
    ]
    return lines


def render(results: Sequence[SizeResult], trace: Trace, costs: dict[str, float], runs: int,
           seed: int, horizon_s: float) -> str:
    out: list[str] = []
    out.append(f"Trace: {trace.source}; drawn as Poisson arrivals per fault kind, scaled "
               f"linearly with the GPU count; {runs} runs per size, seed {seed}; each run a "
               f"job of {horizon_s / 86400:g} days.")
    out.append("")
    ec = f"ec:{int(costs['ftrun_ec_k'])}+{int(costs['ftrun_ec_m'])}"
    out.append("| GPUs | MTBF | faults/run | ftrun ETTR, mean ± sd (min-max) | snapshot every "
               f"| ftrun every=auto | ftrun {ec} | torchrun + DCP ETTR | checkpoint every "
               "(Young / Daly) |")
    out.append("|---:|---:|---:|---|---:|---:|---:|---|---|")
    for r in results:
        b = r.baseline
        out.append(f"| {r.gpus:,} | {_dur(r.mtbf_s)} | {r.ftrun.faults:.1f} | {_ettr(r.ftrun)} "
                   f"| {_dur(r.ftrun.interval_s)} | {r.ftrun_auto.mean:.4f} | "
                   f"{r.ftrun_ec.mean:.4f} | {_ettr(b)} | "
                   f"{_dur(b.interval_s)} ({_dur(b.extra['young_s'])} / "
                   f"{_dur(b.extra['daly_s'])}) |")
    out.append("")
    out.append("Where each loses time (mean share of the wall time):")
    out.append("")
    out.append("| GPUs | launcher | ETTR | checkpoint/snapshot | detection | recovery | "
               "recompute | persist |")
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for s in (r.ftrun, r.ftrun_auto, r.ftrun_ec, r.baseline):
            out.append(f"| {r.gpus:,} | {s.name} | {s.mean:.4f} | "
                       + " | ".join(_pct(s.losses[k]) for k in LOSSES) + " |")
    out.append("")
    last = results[-1]
    out.extend(f"- {line}" for line in decides(last))
    memory = [r for r in results if r.ftrun.memory_lost]
    if memory:
        out.append("- ftrun restored from its persisted copy (both in-memory copies lost) in "
                   + ", ".join(f"{r.ftrun.memory_lost}/{runs} runs at {r.gpus:,}"
                               for r in memory) + ".")
    memory = [r for r in results if r.ftrun_ec.memory_lost]
    if memory:
        out.append(f"- ftrun under {ec} restored from its persisted copy (a second loss in the "
                   "group during a recovery) in "
                   + ", ".join(f"{r.ftrun_ec.memory_lost}/{runs} runs at {r.gpus:,}"
                               for r in memory) + ".")
    out.append(f"- ftrun under {ec} holds {1 + costs['ftrun_ec_m'] / costs['ftrun_ec_k']:.2f}x "
               f"a node's state per node against {costs['ftrun_replicas']:g}x with replicas; a "
               "lost host's state is rebuilt before the spare fetches it.")
    out.append("")
    out.append("Per fault, at " + f"{last.gpus:,} GPUs (detection + recovery, seconds):")
    out.append("")
    out.append("| kind | count/run | ftrun detect | ftrun recover | baseline detect | "
               "baseline recover |")
    out.append("|---|---:|---:|---:|---:|---:|")
    fp = ftrun_policy(costs, last.gpus, last.ftrun.interval_s)
    bp = baseline_policy(costs, last.gpus, last.baseline.interval_s)
    for k in KINDS:
        fd = fp.detect_s[k]
        out.append(f"| {k} | {trace.rate_per_s(k, last.gpus) * horizon_s:.1f} | "
                   f"{'next snapshot' if fd is None else f'{fd:g}'} | {fp.recover_s[k]:.1f} | "
                   f"{bp.detect_s[k]:g} | {bp.recover_s[k]:.1f} |")
    out.append("")
    if trace.source == LLAMA3_SOURCE:
        out.append("Causes mapped to fault kinds:")
        out.append("")
        out.extend(f"- {note}" for note in MAPPING_NOTES)
        out.append("")
    out.append("Costs (`--costs FILE` overrides any; [H100] measured on one H100, [CPU] "
               "measured on CPU at small scale and extrapolated, [assumed] with its source):")
    out.append("")
    tag = {MEASURED_H100: "H100", MEASURED_CPU: "CPU", ASSUMED: "assumed",
           COMPOSED: "composed"}
    for f in FIGURES:
        overridden = "" if costs[f.name] == f.value else f" (overridden; default {f.value:g})"
        out.append(f"- `{f.name}` = {costs[f.name]:g} {f.unit}{overridden} "
                   f"[{tag.get(f.status, f.status)}]: {f.source}")
    return "\n".join(out)


def to_json(results: Sequence[SizeResult], trace: Trace, costs: dict[str, float], runs: int,
            seed: int, horizon_s: float) -> dict[str, Any]:
    return {
        "trace": {"source": trace.source, "gpus": trace.gpus, "duration_s": trace.duration_s,
                  "counts": trace.counts},
        "runs": runs, "seed": seed, "horizon_s": horizon_s,
        "mapping": ([{"cause": c, "count": n, "share_printed": s, "kind": k}
                     for c, n, s, k in LLAMA3_CAUSES]
                    if trace.source == LLAMA3_SOURCE else None),
        "costs": [{"name": f.name, "value": costs[f.name], "default": f.value, "unit": f.unit,
                   "status": f.status, "source": f.source} for f in FIGURES],
        "sizes": [r.as_dict() for r in results],
        "decides": decides(results[-1]) if results else [],
    }


# -- command line -----------------------------------------------------------------------------

def _gpus(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise EttrError(f"--gpus takes GPU counts separated by commas, got {text!r}") from e
    if not values or any(v < 8 for v in values):
        raise EttrError(f"--gpus: every count must be >= 8 (one node), got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default=",".join(map(str, GPUS_DEFAULT)),
                    help="GPU counts to project, comma-separated (8 GPUs per node)")
    ap.add_argument("--runs", type=int, default=RUNS_DEFAULT,
                    help="Monte Carlo draws of the trace per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--days", type=float, default=None,
                    help="job length (default: the trace's, 54 days for Llama 3)")
    ap.add_argument("--trace", help="failure trace, .json or .csv (time_s, kind, scope)")
    ap.add_argument("--trace-gpus", type=int, help="GPUs the trace was observed on (CSV)")
    ap.add_argument("--trace-days", type=float, help="length of the trace in days (CSV)")
    ap.add_argument("--replay", action="store_true",
                    help="simulate the trace file's own events at its own size, once")
    ap.add_argument("--costs", help="JSON object of figure name -> value, over the defaults")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    try:
        if args.runs < 1:
            raise EttrError(f"--runs must be >= 1, got {args.runs}")
        costs = load_costs(args.costs)
        if costs["ftrun_replicas"] < 2:
            raise EttrError("ftrun_replicas must be >= 2: with one copy a lost host's "
                            "snapshot is gone, which this projection does not model")
        if args.trace:
            trace = load_trace(args.trace, args.trace_gpus,
                               None if args.trace_days is None else args.trace_days * 86400)
        elif args.replay or args.trace_gpus or args.trace_days:
            raise EttrError("--replay, --trace-gpus and --trace-days need --trace FILE")
        else:
            trace = llama3_trace()
        horizon = trace.duration_s if args.days is None else args.days * 86400
        if not horizon > 0:
            raise EttrError(f"--days must be > 0, got {args.days}")
        if args.replay:
            results = [project_draws(trace.mtbf_s(trace.gpus), costs, trace.gpus,
                                     [list(trace.events)], horizon)]
            runs = 1
        else:
            runs = args.runs
            results = [project(trace, costs, n, runs, args.seed, horizon)
                       for n in _gpus(args.gpus)]
    except EttrError as e:
        print(f"ettr: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(results, trace, costs, runs, args.seed, horizon), indent=1))
    else:
        print(f"ETTR projection, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"Python {platform.python_version()}")
        print()
        print(render(results, trace, costs, runs, args.seed, horizon))
    return 0


if __name__ == "__main__":
    sys.exit(main())
