"""Which ranks look stuck: the rule behind ``suspect`` in ``ftrun status``.

The launcher samples each of its running ranks on every monitor tick: the process state from
``/proc/<pid>/stat`` and the rank's progress file (``ftrun.progress()``). One
:class:`RankWatch` per rank and (re)start keeps what it needs and judges the rank. A rank is
**suspect** when

* it is stopped (state ``T`` or ``t``: SIGSTOP, a job-control stop, a debugger), from the
  first tick that sees it; or
* it has called ``ftrun.progress()`` before, has not said ``done=True``, and its last call is
  older than its *progress limit*, the smaller of

  - ``max(FACTOR × median step interval, MIN_S)``, once the rank has completed at least
    ``MIN_INTERVALS`` steps; the median is over its last ``WINDOW`` intervals, so a few slow
    steps (an evaluation, a checkpoint, a compilation) neither raise nor trip the limit, and
    ``MIN_S`` keeps short steps from turning a garbage-collection pause into a warning;
  - ``--hang-timeout / 2`` when ``--hang-timeout`` is set: a warning halfway to the kill.

A suspect rank is only reported (heartbeat, event log, ``ftrun status``); nothing is killed
for it. The kill rules of ``--hang-timeout`` and for stopped ranks are the agent's and stay as
they were. Ranks that wait in a collective for a stuck peer stop progressing too, so they turn
suspect once their own wait passes their limit; the peer that is stopped, or whose last step
is the lowest, is the likely culprit.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from ftrun.coordinator.api import RankHealth, SuspectCause
from ftrun.errors import ConfigError
from ftrun.rank.progress import Progress

FACTOR = 5.0
MIN_S = 10.0
MIN_INTERVALS = 3
WINDOW = 20
STOPPED_STATES = frozenset({"T", "t"})


@dataclass(frozen=True)
class SuspectRule:
    """The thresholds of the suspect rule (see the module docstring)."""

    hang_timeout_s: float = 0.0
    factor: float = FACTOR
    min_s: float = MIN_S
    min_intervals: int = MIN_INTERVALS
    window: int = WINDOW

    def __post_init__(self) -> None:
        if not self.hang_timeout_s >= 0:
            raise ConfigError(f"hang_timeout_s must be >= 0, got {self.hang_timeout_s!r}")
        if not self.factor > 0 or not self.min_s >= 0:
            raise ConfigError(f"factor must be > 0 and min_s >= 0, got {self.factor!r} and "
                              f"{self.min_s!r}")
        if not 1 <= self.min_intervals <= self.window:
            raise ConfigError(f"need 1 <= min_intervals <= window, got {self.min_intervals} "
                              f"and {self.window}")

    def limit_s(self, median_interval_s: float | None) -> float | None:
        """The progress limit, or None while there is no basis for one."""
        limits = []
        if median_interval_s is not None:
            limits.append(max(self.factor * median_interval_s, self.min_s))
        if self.hang_timeout_s > 0:
            limits.append(self.hang_timeout_s / 2)
        return min(limits) if limits else None

    def limit_text(self, median_interval_s: float | None) -> str:
        """How :meth:`limit_s` was reached, for the reason line."""
        limit = self.limit_s(median_interval_s)
        if limit is None:
            return "no limit"
        if self.hang_timeout_s > 0 and limit == self.hang_timeout_s / 2:
            return f"limit {limit:.1f} s = --hang-timeout/2"
        assert median_interval_s is not None
        if limit == self.min_s:
            return f"limit {limit:.1f} s, the minimum"
        return f"limit {limit:.1f} s = {self.factor:g} x median step {median_interval_s:.2f} s"


@dataclass(frozen=True)
class Verdict:
    """One rank's health at one tick, with what it was judged on."""

    health: RankHealth
    cause: SuspectCause | None = None
    reason: str | None = None
    step: int | None = None  # the last step it reported, None before its first report
    progress_age_s: float | None = None  # seconds since that report
    step_interval_s: float | None = None  # median of its recent step intervals
    progress_limit_s: float | None = None
    stopped_s: float | None = None  # seconds it has been seen stopped, None when not

    @property
    def suspect(self) -> bool:
        return self.health is RankHealth.SUSPECT

    def fields(self) -> dict[str, Any]:
        """The per-worker fields of a heartbeat and of the status document."""
        return {
            "health": self.health.value,
            "cause": self.cause.value if self.cause is not None else None,
            "reason": self.reason,
            "step": self.step,
            "progress_age_s": _round(self.progress_age_s),
            "step_interval_s": _round(self.step_interval_s, 4),
            "progress_limit_s": _round(self.progress_limit_s),
        }


NOT_WATCHED = Verdict(RankHealth.OK)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class RankWatch:
    """The history of one rank in one incarnation; make a new one at every (re)start."""

    def __init__(self, rule: SuspectRule) -> None:
        self.rule = rule
        self._intervals: deque[float] = deque(maxlen=rule.window)
        self._last: tuple[int, int] | None = None  # (step, monotonic ns) of the newest step
        self._stopped_since_ns: int | None = None

    def median_interval_s(self) -> float | None:
        if len(self._intervals) < self.rule.min_intervals:
            return None
        return float(statistics.median(self._intervals))

    def _sample(self, p: Progress) -> None:
        if self._last is None or p.step < self._last[0]:
            self._last = (p.step, p.monotonic_ns)
            return
        last_step, last_ns = self._last
        if p.step > last_step and p.monotonic_ns >= last_ns:
            # Ticks may skip steps: spread the time evenly over the steps in between.
            self._intervals.append((p.monotonic_ns - last_ns) / 1e9 / (p.step - last_step))
            self._last = (p.step, p.monotonic_ns)

    def observe(self, progress: Progress | None, proc_state: str | None, now_ns: int) -> Verdict:
        """Judge the rank from one tick's reading (``now_ns`` on CLOCK_MONOTONIC)."""
        stopped = proc_state in STOPPED_STATES
        if not stopped:
            self._stopped_since_ns = None
        elif self._stopped_since_ns is None:
            self._stopped_since_ns = now_ns
        step = age_s = None
        done = False
        if progress is not None and progress.reported:
            self._sample(progress)
            step, age_s, done = progress.step, max(0.0, progress.age_s(now_ns)), progress.done
        median = self.median_interval_s()
        limit = self.rule.limit_s(median) if step is not None and not done else None
        common = {"step": step, "progress_age_s": age_s, "step_interval_s": median,
                  "progress_limit_s": limit}
        if stopped:
            assert self._stopped_since_ns is not None
            stopped_s = (now_ns - self._stopped_since_ns) / 1e9
            how = "SIGSTOP or a debugger" if proc_state == "T" else "a tracer"
            return Verdict(RankHealth.SUSPECT, SuspectCause.STOPPED,
                           f"stopped ({how}) for {stopped_s:.1f} s", stopped_s=stopped_s,
                           **common)
        if limit is not None and age_s is not None and age_s > limit:
            return Verdict(RankHealth.SUSPECT, SuspectCause.NO_PROGRESS,
                           f"no progress for {age_s:.1f} s after step {step} "
                           f"({self.rule.limit_text(median)})", **common)
        return Verdict(RankHealth.OK, **common)
