"""Which steps get a snapshot (``Cadence``: every K-th step, fixed or chosen online), and the
snapshot wait knob read as seconds."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

import torch

from ftrun import knobs
from ftrun.errors import ConfigError

log = logging.getLogger("ftrun.rank.snapshotter")


def _non_negative(knob: knobs.Knob, what: str) -> float:
    raw = knob.get()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{knob.name} must be a number of {what}, got {raw!r}")
    return value


def seconds(knob: knobs.Knob) -> float:
    return _non_negative(knob, "seconds >= 0 (0: never wait)")


def gpu_mtbf_hours() -> float:
    """``FTRUN_GPU_MTBF_HOURS``: expected hours between interruptions per rank (0: off)."""
    return _non_negative(knobs.GPU_MTBF_HOURS, "hours >= 0 (0: ignore the failure rate)")


def young_interval_s(cost_s: float, world_size: int, gpu_mtbf_h: float,
                     cap_s: float) -> float:
    """Young's optimal time between snapshots, ``sqrt(2 * cost * MTBF)``, for a snapshot that
    costs ``cost_s`` of training in a job whose ``world_size`` ranks each fail every
    ``gpu_mtbf_h`` hours on average; at most ``cap_s``. 0 when either is unknown (0)."""
    if cost_s <= 0 or gpu_mtbf_h <= 0:
        return 0.0
    mtbf_s = gpu_mtbf_h * 3600.0 / max(1, world_size)
    return min(cap_s, math.sqrt(2.0 * cost_s * mtbf_s))


class Cadence:
    """Which steps get a snapshot: every K-th step, K fixed, or chosen online ("auto").

    Under "auto" each rank times its steps (from one save() call to the next) and keeps the
    durations of steps that overlapped a snapshot's copy apart from the others. A snapshot
    costs the difference of their medians; K is the smallest interval whose cost stays at
    or below ``TARGET`` of the step time, and no shorter than Young's interval
    (:func:`young_interval_s`: where a longer interval would cost more in steps recomputed
    after a failure than it saves in snapshots) for the job's failure rate
    (``FTRUN_GPU_MTBF_HOURS`` over the world size), capped at ``MAX_INTERVAL_S`` of training
    so that a fault never loses more than that. Every ``AGREE_EVERY`` steps the ranks agree on the
    largest K any of them wants (a one-integer all_reduce), so all snapshot the same steps.
    Until both kinds of step have been seen, K is ``WARMUP_K``.

    A snapshot given up because the store had not released a buffer (the one before it not
    yet verified and committed) says the pipeline behind the copy (the store's hashing,
    replication) needs more than K steps, a cost the step times do not show (it runs in
    other processes and threads, on the same CPUs). Such a skip sets a floor of twice the K it
    happened at, kept for the run: K then never comes back down to where snapshots were lost.
    """

    TARGET = 0.03
    MAX_INTERVAL_S = 60.0
    AGREE_EVERY = 32
    WARMUP_K = 2
    MAX_K = 10_000
    WINDOW = 32

    def __init__(self, every: int | str, gpu_mtbf_h: float | None = None) -> None:
        text = str(every).strip().lower()
        self.gpu_mtbf_h = gpu_mtbf_hours() if gpu_mtbf_h is None else gpu_mtbf_h
        self.auto = text == "auto"
        if self.auto:
            self.k = self.WARMUP_K
        else:
            try:
                self.k = int(text)
            except ValueError:
                self.k = 0
            if self.k < 1:
                raise ConfigError(f"the snapshot interval must be a number of steps >= 1 or "
                                  f"'auto', got {every!r} (Snapshotter(every=...), "
                                  f"--snapshot-every, {knobs.SNAPSHOT_EVERY.name})")
        self._with_copy: deque[float] = deque(maxlen=self.WINDOW)
        self._plain: deque[float] = deque(maxlen=self.WINDOW)
        self._blocked: deque[float] = deque(maxlen=self.WINDOW)
        self._last_due = False
        self._skips = 0  # snapshots given up since the last agreement
        self.floor = 1  # from skips: the smallest K that may keep up
        self.why = ""  # what set the last wanted() interval, when not the cost target

    def due(self, step: int) -> bool:
        return step % self.k == 0

    def mark(self, due: bool) -> None:
        self._last_due = due

    @property
    def last_due(self) -> bool:
        """Whether the step now running takes a snapshot."""
        return self._last_due

    def blocked(self, seconds: float) -> None:
        """A step that took a snapshot spent ``seconds`` of its training thread in save() and
        wait(): what the snapshot cost it at the least."""
        self._blocked.append(max(0.0, seconds))

    def observe(self, step_s: float) -> None:
        """The step that just ended took ``step_s``; it overlapped a copy if the last was due."""
        (self._with_copy if self._last_due else self._plain).append(step_s)

    def skipped(self) -> None:
        """A snapshot was given up: the store had not released a buffer in time."""
        self._skips += 1

    def cost(self) -> tuple[float, float] | None:
        """(seconds a snapshot adds to its step, seconds of a step without one), once known.

        The difference of the step times, and never less than what the training thread
        itself spent in the snapshot's save() and wait() (when it was told): on a busy host
        the steps without a snapshot can measure as slow as those with one, and a cost of 0
        would ask for a snapshot every step."""
        if len(self._with_copy) < 3 or len(self._plain) < 3:
            return None
        plain = statistics.median(self._plain)
        floor = statistics.median(self._blocked) if self._blocked else 0.0
        return max(0.0, statistics.median(self._with_copy) - plain, floor), plain

    def wanted(self, world_size: int = 1) -> int:
        """The interval this rank would pick in a job of ``world_size`` ranks."""
        if self._skips:
            self.floor = min(self.MAX_K, max(self.floor, 2 * self.k))
        known = self.cost()
        if known is None:
            want = self.k if self.k > 1 else self.WARMUP_K
        elif known[1] <= 0:
            want = self.k
        else:
            cost, plain = known
            want = math.ceil(cost / (self.TARGET * plain))
            young = young_interval_s(cost, world_size, self.gpu_mtbf_h, self.MAX_INTERVAL_S)
            if math.floor(young / plain) > want:
                want = math.floor(young / plain)
                self.why = (f"; a snapshot costs {cost * 1e3:.1f} ms and the job's {world_size} "
                            f"rank(s) fail every {self.gpu_mtbf_h * 3600 / world_size:.0f} s "
                            f"on average: worth one every {young:.1f} s (Young's interval, "
                            f"at most {self.MAX_INTERVAL_S:g} s)")
        return max(self.floor, min(self.MAX_K, want))

    def agree(self, step: int) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.why = ""
        want = self.wanted(dist.get_world_size() if distributed else 1)
        skips, self._skips = self._skips, 0
        if distributed:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
            t = torch.tensor([want], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            want = int(t.item())
        if want != self.k:
            why = (f"; {skips} snapshot(s) given up since the last change: the store had not "
                   f"released a buffer" if skips else self.why)
            log.info("snapshot interval: every %d step(s) from step %d (was %d%s)", want, step,
                     self.k, why)
        self.k = want
