"""The collective monitor: each rank's collectives, timed from torch's own records and
reported to the coordinator, which compares them across ranks (ftrun.coordinator.detect).

torch's Flight Recorder counts every collective of every process group, on gloo as on NCCL:
per group, the sequence number of the last collective enqueued, started and completed
(``pg_status``). That covers blocking and ``async_op`` collectives alike, DDP's gradient
all-reduce and FSDP2's all-gathers and reduce-scatters, since they all go through process
groups. What each backend gives:

- **gloo**: enqueued and completed counts; no durations (its entries' ``duration_ms`` stays
  empty, and it has no completion hook). The monitor times collectives itself.
- **NCCL**: the same counts, plus ``started`` (when the kernel began) once
  ``TORCH_NCCL_ENABLE_TIMING=1``, which the launcher sets for the ranks unless the user set it.
  A collective's duration then runs from its start rather than from its enqueue, which on a
  GPU runs ahead of the kernels.

A thread of the rank reads ``pg_status`` every ``FTRUN_COLL_INTERVAL`` seconds (0.02 s: a
read costs about 5 µs) and notes, on the rank's own monotonic clock, when each sequence number
was first seen enqueued (started, on NCCL) and completed. A collective's duration is the
difference; its resolution is one interval. Each wake-up costs the training process about
0.1 ms of CPU while it computes (mostly taking the GIL, twice), so the thread reads that often
only while it matters: the coordinator looks at collectives that kept a rank waiting at least
``LONG_S`` (its lateness floor, ``DetectConfig.slow_min_s``). Once none has for
``IDLE_AFTER_S``, the thread reads every ``COARSE_FACTOR`` intervals, and ``LONG_S`` after a
read that finds a collective pending, so the first one to last ``LONG_S`` brings the fine
reads back (its own duration is counted from the coarse read that first saw it).

Once as it starts (so that the coordinator knows the rank from then on, and names it if it
falls silent in its first steps), every 0.5 s, and at once when a wait passes 1 s, the
monitor sends a ``coll_report`` to the coordinator's detection endpoint (``FTRUN_DETECT``):
per group, the counts, how long the pending collective has waited, and the collectives that
took at least one interval with their durations. Only local durations travel; no clock
reading is ever compared across hosts. A collective that waits past 1 s is looked up once in
the full Flight Recorder dump (tens of ms) for its op and size; the steady state never dumps.

The thread never blocks training: sends that cannot be queued are dropped (and said once),
errors are logged (rate-limited) and the loop goes on.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ftrun import _torch, knobs
from ftrun.rank import progress

log = logging.getLogger(__name__)

REPORT_S = 0.5
# Reads every COARSE_FACTOR intervals once no collective lasted LONG_S for IDLE_AFTER_S (see
# the module docstring).
COARSE_FACTOR = 5
IDLE_AFTER_S = 2.0
LONG_S = 0.05
URGENT_WAIT_S = 1.0
MAX_DONE = 256  # durations listed per group and report (the newest)
MAX_TRACKED = 4096  # enqueued collectives remembered per group
MAX_RANKS_LISTED = 64
WARN_EVERY_S = 60.0
# A full dump holds the GIL for tens of ms: at most one per this many seconds.
DUMP_EVERY_S = 10.0
SEND_TIMEOUT_S = 0.05
IDLE_CPU = 0.1  # cores: below this (and IDLE_IO_BPS) the process is idle (see Activity)
IDLE_IO_BPS = 256 << 10  # bytes a second read and written through system calls
LEAVE_LINGER_S = 0.2  # what the last report (leaving) gets to go out as the monitor closes
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
               "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1,
               "Float8_e5m2": 1, "ComplexFloat": 8, "ComplexDouble": 16}


@dataclass
class _Group:
    """What the monitor tracks of one process group."""

    name: str
    enqueued: int
    started: int
    completed: int
    size: int = 0
    ranks: list[int] | None = None
    since: dict[int, float] = field(default_factory=dict)  # seq -> first seen enqueued/started
    done: list[list[float]] = field(default_factory=list)  # [seq, duration_s], unsent
    op: tuple[int, str, int | None] | None = None  # (seq, op, bytes) of a long wait
    urgent_sent: int = -1  # the pending seq whose long wait was reported at once


class CollectiveMonitor:
    """Times this rank's collectives and reports them (see the module docstring)."""

    def __init__(self, endpoint: str, secret: bytes, run_id: str, *, rank: int,
                 world_size: int, backend: str, node_id: str, host: str, restart: int,
                 interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        from ftrun.protocol.transport import Client

        self.endpoint = endpoint
        self.interval_s = interval_s
        self._base = {"node_id": node_id, "host": host, "rank": rank,
                      "world_size": world_size, "restart": restart, "pid": os.getpid(),
                      "backend": backend, "interval_s": interval_s,
                      # new every rendezvous round (torch picks a new master port)
                      "world": f"{os.environ.get('MASTER_ADDR', '')}:"
                               f"{os.environ.get('MASTER_PORT', '')}"}
        self._client = Client(endpoint, secret, run_id, f"rank{rank}/{os.getpid()}",
                              peer="coordinator's detection endpoint",
                              send_timeout_s=SEND_TIMEOUT_S, sndhwm=16, follow_on_send=True,
                              resend_stale=16)
        self._groups: dict[str, _Group] = {}
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_warn: dict[str, float] = {}
        self._last_dump = float("-inf")
        # When a collective last lasted LONG_S; fine reads for IDLE_AFTER_S from the start.
        self._last_long = time.monotonic()
        self._pending = False  # the last read found a collective pending
        self._wait_since = 0.0  # what the progress file says: the oldest pending wait's start
        self._activity = Activity()
        self.counters = {"samples": 0, "reports": 0, "dropped": 0, "dumps": 0, "errors": 0}

    def start(self) -> None:
        if self._thread is not None:
            return
        # The first report goes out now, not REPORT_S from now: the coordinator names a rank
        # as silent only once it has heard from it, so a rank that froze or died within
        # REPORT_S of its monitor's start (in its first steps) was unknown to it, and the
        # others' waits were blamed on nobody. Sent before the thread exists (one socket
        # user at a time); it waits SEND_TIMEOUT_S at most.
        self._step(time.monotonic(), due=True)
        self._thread = threading.Thread(target=self._run, name="ftrun-collectives",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop reporting: one last report, marked ``leaving``, tells the coordinator that this
        rank's silence from now on is its leaving (its process exits, or its training function
        returned) rather than a hang; it gets LEAVE_LINGER_S to go out."""
        self._stop.set()
        started = self._thread is not None
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._wait_since:
            self._wait_since = 0.0
            progress.collective_wait(0)
        if started:
            try:
                try:
                    self.sample(time.monotonic())
                except Exception:  # noqa: BLE001 - the groups may be gone: report as last read
                    pass
                self.report(time.monotonic(), leaving=True)
            except Exception as e:  # noqa: BLE001 - leaving must never fail the rank
                log.debug("could not send the leaving report: %s", e)
        self._client.close(LEAVE_LINGER_S if started else 0.0)

    # -- the thread --------------------------------------------------------------------------

    def next_wait(self, now: float) -> float:
        """Seconds until the next read: one interval while collectives last LONG_S; else
        COARSE_FACTOR intervals, or LONG_S when this read found one pending (still pending
        then, it lasted LONG_S)."""
        if now - self._last_long < IDLE_AFTER_S:
            return self.interval_s
        coarse = self.interval_s * COARSE_FACTOR
        return min(LONG_S, coarse) if self._pending else coarse

    def _run(self) -> None:
        next_report = time.monotonic() + REPORT_S
        while not self._stop.wait(self.next_wait(time.monotonic())):
            now = time.monotonic()
            if self._step(now, due=now >= next_report):
                next_report = now + REPORT_S

    def _step(self, now: float, due: bool) -> bool:
        """One read, and a report when ``due`` or a wait just passed URGENT_WAIT_S; True
        when it reported."""
        try:
            if self.sample(now) or due:
                self.report(now)
                return True
        except Exception as e:  # noqa: BLE001 - the monitor must never stop a rank
            self.counters["errors"] += 1
            self._warn("error", "collective monitor error (%s: %s); going on",
                       type(e).__name__, e)
        return False

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_warn.get(key, float("-inf")) >= WARN_EVERY_S:
            self._last_warn[key] = now
            log.warning(msg, *args)

    def sample(self, now: float) -> bool:
        """Read ``pg_status`` once; True when a wait just passed URGENT_WAIT_S."""
        status = _torch.fr_dump(False).get("pg_status") or {}
        self.counters["samples"] += 1
        urgent = False
        self._pending = False
        oldest = 0.0
        for name, st in status.items():
            enq = int(st.get("last_enqueued_collective", -1))
            started = int(st.get("last_started_collective", -1))
            comp = int(st.get("last_completed_collective", -1))
            g = self._groups.get(name)
            if g is None:
                g = self._groups[name] = _Group(name, enq, started, comp)
                self._describe(g)
                for seq in range(comp + 1, enq + 1):  # pending when first seen: from now
                    g.since[seq] = now
                continue
            if enq > g.enqueued:
                for seq in range(max(g.enqueued + 1, enq - MAX_TRACKED + 1), enq + 1):
                    g.since[seq] = now
                g.enqueued = enq
            if started > g.started:  # NCCL with timing: time from the kernel's start
                for seq in range(max(g.started + 1, started - MAX_TRACKED + 1), started + 1):
                    g.since[seq] = now
                g.started = started
            if comp > g.completed:
                for seq in range(g.completed + 1, comp + 1):
                    t0 = g.since.pop(seq, None)
                    # Seen pending at an earlier sample: it took at least one interval.
                    if t0 is not None and now > t0:
                        g.done.append([seq, round(now - t0, 4)])
                del g.done[:-MAX_DONE]
                g.completed = comp
                if len(g.since) > MAX_TRACKED:
                    for seq in sorted(g.since)[:-MAX_TRACKED]:
                        del g.since[seq]
            pending = g.completed + 1
            if g.enqueued >= pending:
                self._pending = True
                t0 = g.since.get(pending)
                if t0 is not None and (not oldest or t0 < oldest):
                    oldest = t0
                # Pending since a read LONG_S ago (a completed one's duration only bounds
                # its own from above: it may have ended just after the previous read).
                if t0 is not None and now - t0 >= LONG_S - 1e-6:  # 1 µs: float rounding
                    self._last_long = now
                if t0 is not None and now - t0 >= URGENT_WAIT_S and g.urgent_sent != pending:
                    g.urgent_sent = pending
                    self._look_up(g, pending)
                    urgent = True
        if oldest != self._wait_since:
            # For the launcher's hang check: a rank blocked in a collective waits for a peer.
            self._wait_since = oldest
            progress.collective_wait(int(oldest * 1e9))
        return urgent

    def _describe(self, g: _Group) -> None:
        """The group's size and (small groups) global ranks, from torch's registry."""
        try:
            import torch.distributed as dist

            pg = _torch.process_groups().get(g.name)
            if pg is None:
                return
            g.size = dist.get_world_size(pg)
            if g.size <= MAX_RANKS_LISTED:
                g.ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
        except Exception as e:  # noqa: BLE001 - the group is reported without them
            self._warn("describe", "cannot read process group %s's ranks (%s: %s)", g.name,
                       type(e).__name__, e)

    def _look_up(self, g: _Group, seq: int) -> None:
        """The op and size of a collective that waits long, from one full dump (at most one
        per DUMP_EVERY_S: it holds the GIL for tens of ms)."""
        now = time.monotonic()
        if now - self._last_dump < DUMP_EVERY_S:
            return
        self._last_dump = now
        self.counters["dumps"] += 1
        for e in _torch.fr_dump(True).get("entries") or []:
            pg = e.get("process_group") or [None]
            if str(pg[0]) == g.name and int(e.get("collective_seq_id", -1)) == seq:
                nbytes: int | None = 0
                for shape, dtype in zip(e.get("input_sizes") or [], e.get("input_dtypes") or [],
                                        strict=False):
                    n = 1
                    for d in shape:
                        n *= int(d)
                    size = DTYPE_BYTES.get(str(dtype))
                    if size is None or nbytes is None:
                        nbytes = None  # a dtype not known here: no size rather than a guess
                        continue
                    nbytes += n * size
                g.op = (seq, str(e.get("profiling_name", "")), nbytes)
                return

    def report(self, now: float, leaving: bool = False) -> bool:
        """Send one ``coll_report`` (``leaving``: the last one, see :meth:`stop`); False when
        it could not be queued (dropped)."""
        groups = []
        for g in self._groups.values():
            pending = g.completed + 1
            t0 = g.since.get(pending) if g.enqueued >= pending else None
            entry: dict[str, Any] = {
                "pg": g.name, "size": g.size, "enqueued": g.enqueued, "completed": g.completed,
                "waiting_s": round(now - t0, 4) if t0 is not None else None,
            }
            if g.ranks is not None:
                entry["ranks"] = g.ranks
            if g.done:
                entry["done"] = g.done
            if g.op is not None and g.op[0] == pending:
                entry["op"] = g.op[1]
                if g.op[2] is not None:
                    entry["bytes"] = g.op[2]
            groups.append(entry)
        self._seq += 1
        body = {**self._base, "seq": self._seq, "groups": groups}
        # Idleness matters for a culprit, which waits in no collective: a rank waiting in
        # one is not idle (and its reading of /proc is skipped).
        if self._pending:
            self._activity.reset()
        else:
            idle = self._activity.idle_s(now)
            if idle is not None:
                body["idle_s"] = round(idle, 3)
        if leaving:
            body["leaving"] = True
        sent = self._client.send("coll_report", body) is not None
        if sent:
            self.counters["reports"] += 1
            for g in self._groups.values():
                g.done = []
        else:
            self.counters["dropped"] += 1
            self._warn("dropped", "the coordinator's detection endpoint %s is not taking "
                       "reports; dropping them (training goes on)", self.endpoint)
        return sent


class Activity:
    """How long this process has been idle: it and its child processes (a data loader's
    workers) together using, or waiting in the run queue for, under IDLE_CPU of a core and
    moving under IDLE_IO_BPS through their file and socket calls (``/proc/<pid>/io``), as
    sampled at each report. A rank outside any collective that is idle while its peers wait
    for it is hung (a sleep, a lock, a queue nobody fills); one that computes, reads or writes
    (an evaluation, a checkpoint, data loader workers fetching a slow batch) is busy, and the
    coordinator gives it ``busy_hang_s``. Time spent runnable but not run counts as busy: on
    an overloaded host a rank that wants the CPU gets a few percent of a core, which alone
    would read as idle (seen in CI at a load of ~20 on 2 CPUs: a restored rank named hung
    after 4.6 s)."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[int, tuple[float, int]]] | None = None
        self._idle_since: float | None = None

    def reset(self) -> None:
        """Busy now (it waits in a collective): the next reading starts afresh."""
        self._last = None
        self._idle_since = None

    def idle_s(self, now: float) -> float | None:
        """Seconds idle as of ``now`` (None: busy, or not known yet)."""
        sample = _activity()
        last, self._last = self._last, (now, sample)
        if last is None or now - last[0] <= 0 or not sample:
            return None
        span = now - last[0]
        cpu = io = 0.0
        for pid, (c, b) in sample.items():
            before = last[1].get(pid)
            if before is None:  # a new child (a worker started): activity
                self._idle_since = None
                return None
            cpu += c - before[0]
            io += b - before[1]
        if cpu / span >= IDLE_CPU or io / span >= IDLE_IO_BPS:
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = last[0]
        return now - self._idle_since


_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _run_delay_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent runnable, waiting for a CPU
    (``/proc/<pid>/task/*/schedstat``'s second field; 0 where the kernel keeps no such
    statistics). Threads that ended since the last reading drop out of the sum, which can
    only make a process read idler, never busier."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _activity() -> dict[int, tuple[float, int]]:
    """pid -> (CPU seconds used or waited for in the run queue, bytes read and written
    through system calls) of this process and its children (empty where /proc cannot be
    read)."""
    me = os.getpid()
    pids = [me]
    try:  # the main thread's children: a data loader's workers are started from it
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            pids += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        pass
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            with open(f"/proc/{pid}/io", "rb") as f:
                text = f.read()
        except OSError:
            continue  # a child that just ended
        cpu = (int(fields[11]) + int(fields[12])) * _TICK_S + _run_delay_s(pid)  # utime, stime
        io = sum(int(line.split()[1]) for line in text.splitlines()
                 if line.startswith((b"rchar:", b"wchar:")))
        out[pid] = (cpu, io)
    return out


_monitor: CollectiveMonitor | None = None
_monitor_pid = 0
_monitor_world: tuple[int, int, int] = (-1, -1, -1)  # rank, world size, restart count
_lock = threading.Lock()


def stop_monitor() -> None:
    """Stop this process's collective monitor, if one runs (``@ftrun.resilient`` calls it
    when the training function leaves: the groups it watched are gone, and a run in the new
    world starts a monitor of its own, with the new rank, world size and restart count)."""
    global _monitor
    with _lock:
        monitor, _monitor = _monitor, None
    if monitor is not None and _monitor_pid == os.getpid():
        monitor.stop()


def _world_now() -> tuple[int, int, int]:
    """The world this process runs in: RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT (an
    in-process restart changes the environment like a new process would see it)."""
    def num(name: str) -> int:
        try:
            return int(os.environ.get(name) or 0)
        except ValueError:
            return 0
    return num("RANK"), num("WORLD_SIZE"), num("TORCHELASTIC_RESTART_COUNT")


def monitor_collectives() -> CollectiveMonitor | None:
    """Start this rank's collective monitor, once per process; returns it, or None when
    there is nothing to report to (not launched by ftrun, or no process group yet).

    ``Snapshotter`` calls this itself; a script without snapshots calls it once after
    ``init_process_group``. Under plain torchrun or python it only logs that it is off.
    """
    global _monitor, _monitor_pid, _monitor_world
    with _lock:
        if _monitor is not None and _monitor_pid == os.getpid():
            if _monitor_world == _world_now():
                return _monitor
            # An in-process restart without stop_monitor(): the old world's monitor goes.
            _monitor.stop()
            _monitor = None
        endpoint = knobs.DETECT.get()
        if not endpoint:
            log.debug("collective monitor off: no %s (not launched by ftrun, or the job "
                      "runs no detection)", knobs.DETECT.name)
            return None
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            log.warning("collective monitor not started: call it after "
                        "torch.distributed.init_process_group()")
            return None
        secret = knobs.SECRET.get().encode()
        if not secret:
            log.warning("collective monitor not started: no %s", knobs.SECRET.name)
            return None
        try:
            interval_s = float(knobs.COLL_INTERVAL.get())
        except ValueError:
            log.warning("%s=%r is not a number of seconds; using %s", knobs.COLL_INTERVAL.name,
                        knobs.COLL_INTERVAL.get(), knobs.COLL_INTERVAL.default)
            interval_s = float(knobs.COLL_INTERVAL.default)
        monitor = CollectiveMonitor(
            endpoint, secret, knobs.RUN_ID.get(), rank=dist.get_rank(),
            world_size=dist.get_world_size(), backend=str(dist.get_backend()),
            node_id=knobs.NODE_ID.get() or socket.gethostname(), host=socket.gethostname(),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
            interval_s=interval_s)
        monitor.start()
        atexit.register(monitor.stop)
        _monitor, _monitor_pid, _monitor_world = monitor, os.getpid(), _world_now()
        log.debug("collective monitor reporting to %s every %.2f s (sampling every %.3f s)",
                  endpoint, REPORT_S, interval_s)
        return monitor
