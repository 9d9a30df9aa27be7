"""The suspect rule (ftrun.launcher.suspect) on synthetic timelines of progress reports."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import ROOT

from ftrun.coordinator.api import JobHealth, RankHealth, SuspectCause
from ftrun.errors import ConfigError
from ftrun.launcher.suspect import RankWatch, SuspectRule
from ftrun.rank.progress import DONE, Progress

S = 1_000_000_000  # ns per second


def run(watch: RankWatch, steps: list[tuple[int, float]], now_s: float,
        proc_state: str | None = "S", done: bool = False):
    """Feed ``(step, time_s)`` reports tick by tick, then judge the rank at ``now_s``."""
    for step, t in steps:
        watch.observe(Progress(step, int(t * S)), "R", int(t * S))
    last_step, last_t = steps[-1] if steps else (-1, 0.0)
    p = Progress(last_step, int(last_t * S), DONE if done else 0) if steps else None
    return watch.observe(p, proc_state, int(now_s * S))


def steady(n: int, every_s: float, start_s: float = 100.0) -> list[tuple[int, float]]:
    return [(i, start_s + i * every_s) for i in range(1, n + 1)]


def test_steady_rank_is_ok_until_its_limit() -> None:
    watch = RankWatch(SuspectRule(min_s=1.0))
    steps = steady(10, 0.5)  # last report at 105.0; limit max(5 x 0.5, 1) = 2.5 s
    v = run(watch, steps, 107.4)
    assert v.health is RankHealth.OK and v.cause is None
    assert v.step == 10 and v.step_interval_s == pytest.approx(0.5)
    assert v.progress_limit_s == pytest.approx(2.5) and v.progress_age_s == pytest.approx(2.4)
    v = watch.observe(Progress(10, 105 * S), "S", int(107.6 * S))
    assert v.health is RankHealth.SUSPECT and v.cause is SuspectCause.NO_PROGRESS
    assert "no progress for 2.6 s after step 10" in v.reason and "5 x median step 0.50 s" in v.reason
    assert v.fields()["health"] == "suspect" and v.fields()["cause"] == "no_progress"


def test_floor_keeps_short_steps_from_tripping() -> None:
    # 10 ms steps: 5 x median is 50 ms, but a 3 s pause stays under the 10 s minimum.
    watch = RankWatch(SuspectRule())
    v = run(watch, steady(50, 0.01), 100.5 + 3.0)
    assert v.health is RankHealth.OK and v.progress_limit_s == 10.0
    v = watch.observe(Progress(50, int(100.5 * S)), "S", int(111 * S))
    assert v.suspect and "the minimum" in v.reason


def test_median_ignores_a_few_slow_steps() -> None:
    # One evaluation step of 60 s among 1 s steps moves the median nowhere.
    watch = RankWatch(SuspectRule(min_s=1.0))
    steps = steady(10, 1.0)
    steps.append((11, steps[-1][1] + 60.0))
    steps += [(12 + i, steps[-1][1] + (i + 1) * 1.0) for i in range(5)]
    v = run(watch, steps, steps[-1][1] + 4.0)
    assert v.step_interval_s == pytest.approx(1.0) and v.health is RankHealth.OK
    v = watch.observe(Progress(*_at(steps[-1])), "S", int((steps[-1][1] + 5.5) * S))
    assert v.suspect


def _at(report: tuple[int, float]) -> tuple[int, int]:
    return report[0], int(report[1] * S)


def test_skipped_ticks_spread_time_over_steps() -> None:
    # The launcher saw steps 1, 5 and 9 only: four steps per 2 s is 0.5 s per step.
    watch = RankWatch(SuspectRule(min_s=0.0, min_intervals=2))
    v = run(watch, [(1, 100.0), (5, 102.0), (9, 104.0)], 104.1)
    assert v.step_interval_s == pytest.approx(0.5) and v.progress_limit_s == pytest.approx(2.5)


def test_no_basis_no_suspicion_without_hang_timeout() -> None:
    # Two reports are too few for a median, and no --hang-timeout: no limit at all.
    watch = RankWatch(SuspectRule())
    v = run(watch, [(1, 100.0), (2, 101.0)], 10_000.0)
    assert v.health is RankHealth.OK and v.progress_limit_s is None
    # A rank that never reported is not timed either.
    assert RankWatch(SuspectRule(hang_timeout_s=4)).observe(
        Progress(-1, 0), "S", 10_000 * S).health is RankHealth.OK


def test_hang_timeout_half_is_the_limit_when_smaller() -> None:
    rule = SuspectRule(hang_timeout_s=8.0)
    watch = RankWatch(rule)
    v = run(watch, [(1, 100.0)], 104.5)  # one report is enough with --hang-timeout
    assert v.suspect and v.progress_limit_s == 4.0 and "--hang-timeout/2" in v.reason
    # With fast steps the adaptive limit (10 s minimum) is larger: hang-timeout/2 stays.
    watch = RankWatch(rule)
    assert run(watch, steady(10, 0.1), 101.0 + 3.9).health is RankHealth.OK
    # With a generous --hang-timeout, the adaptive limit is the smaller one.
    watch = RankWatch(SuspectRule(hang_timeout_s=600.0, min_s=1.0))
    v = run(watch, steady(10, 1.0), 110.0 + 5.5)
    assert v.suspect and v.progress_limit_s == pytest.approx(5.0)


def test_done_rank_is_not_timed() -> None:
    watch = RankWatch(SuspectRule(hang_timeout_s=2.0))
    v = run(watch, steady(5, 0.1), 10_000.0, done=True)
    assert v.health is RankHealth.OK and v.progress_limit_s is None


def test_stopped_rank_is_suspect_at_once_and_clears_on_continue() -> None:
    watch = RankWatch(SuspectRule())
    steps = steady(5, 0.2)
    v = run(watch, steps, 101.1, proc_state="T")
    assert v.suspect and v.cause is SuspectCause.STOPPED and v.stopped_s == 0.0
    assert "stopped (SIGSTOP" in v.reason
    v = watch.observe(Progress(*_at(steps[-1])), "T", int(103.1 * S))
    assert v.stopped_s == pytest.approx(2.0) and "for 2.0 s" in v.reason
    v = watch.observe(Progress(6, int(103.2 * S)), "R", int(103.3 * S))
    assert v.health is RankHealth.OK and v.stopped_s is None
    # Stopped before it ever reported progress, or by a tracer: suspect all the same.
    assert RankWatch(SuspectRule()).observe(None, "t", 5 * S).cause is SuspectCause.STOPPED


def test_restarted_progress_rebases() -> None:
    # A progress file reset (step back to a lower value) starts a new baseline, no negative
    # or huge interval.
    watch = RankWatch(SuspectRule(min_s=0.0, min_intervals=1, window=1))
    assert run(watch, steady(6, 1.0), 106.0).step_interval_s == pytest.approx(1.0)
    v = run(watch, [(3, 200.0), (4, 200.2)], 200.3)
    assert v.step_interval_s == pytest.approx(0.2) and v.step == 4


def test_rule_validation() -> None:
    with pytest.raises(ConfigError, match="hang_timeout_s must be >= 0"):
        SuspectRule(hang_timeout_s=-1)
    with pytest.raises(ConfigError, match="min_intervals"):
        SuspectRule(min_intervals=30, window=20)


def test_states_are_plain_strings_on_the_wire() -> None:
    assert JobHealth.DEGRADED == "degraded" and "degraded" in {JobHealth.DEGRADED}
    assert json.dumps({"health": JobHealth.DEGRADED}) == '{"health": "degraded"}'
    assert f"{RankHealth.SUSPECT}" == "suspect" and str(SuspectCause.NO_PROGRESS) == "no_progress"


def test_the_collective_wait_travels_in_the_progress_file(tmp_path, monkeypatch):
    """The collective monitor's thread writes since when the rank waits in a collective next
    to the training thread's step; the launcher reads both (--hang-timeout spares a rank
    blocked in a collective: it waits for a peer)."""
    from ftrun.rank import progress as prog

    path = tmp_path / "progress-0"
    prog.create_progress_file(str(path))
    monkeypatch.setenv("FTRUN_PROGRESS_FILE", str(path))
    monkeypatch.setattr(prog, "_map", None)
    prog.progress(7)
    p = prog.read_progress(str(path))
    assert p is not None and p.step == 7 and p.collective_wait_s() is None
    since = time.monotonic_ns() - 3 * S
    prog.collective_wait(since)
    p = prog.read_progress(str(path))
    assert p is not None and p.step == 7 and 3.0 <= p.collective_wait_s() < 10.0
    prog.progress(8)  # a step does not touch the wait, nor the wait the step
    p = prog.read_progress(str(path))
    assert p is not None and p.step == 8 and p.coll_since_ns == since
    prog.collective_wait(0)
    assert prog.read_progress(str(path)).collective_wait_s() is None
    prog._forget()


def test_activity_tells_an_idle_process_from_a_busy_one():
    from ftrun.rank.collectives import Activity

    a = Activity()
    t = time.monotonic()
    assert a.idle_s(t) is None  # no basis yet
    time.sleep(0.3)
    t1 = time.monotonic()
    idle = a.idle_s(t1)
    assert idle is not None and idle >= 0.25  # slept: idle since the first reading
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # a busy loop: a core's worth of CPU
        pass
    assert a.idle_s(time.monotonic()) is None


STARVED = """
import os, sys, time
from ftrun.rank.collectives import Activity
os.sched_setaffinity(0, {int(sys.argv[1])})
os.nice(19)
a = Activity()
a.idle_s(time.monotonic())
cpu = time.process_time()
end = time.monotonic() + 1.5
while time.monotonic() < end:  # wants a whole core; gets a few percent of one
    pass
used = time.process_time() - cpu
print(a.idle_s(time.monotonic()), used, flush=True)
"""


def test_activity_tells_a_starved_process_from_an_idle_one():
    """A rank that wants the CPU but waits in the run queue behind busier processes (an
    overloaded host) is busy, not idle: its own CPU use alone is a few percent of a core."""
    import subprocess
    import sys

    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        pytest.skip("this kernel keeps no scheduler statistics (/proc/PID/schedstat)")
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = ("import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
           "t = time.time() + 30\nwhile time.time() < t: pass")
    hogs = [subprocess.Popen([sys.executable, "-c", hog, str(cpu)]) for _ in range(2)]
    try:
        out = subprocess.run([sys.executable, "-c", STARVED, str(cpu)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        idle, used = out.stdout.split()
        assert float(used) < 0.1 * 1.5, f"the fault did not fire: it got {used} s of CPU"
        assert idle == "None", f"a starved process read idle for {idle} s"
    finally:
        for h in hogs:
            h.kill()
            h.wait(timeout=30)


def test_activity_counts_the_child_processes(tmp_path):
    """A data loader's workers busy fetching a batch make the rank busy, not idle."""
    import subprocess
    import sys

    from ftrun.rank.collectives import Activity

    a = Activity()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 60\n"
                              "while time.time() < t: pass"])
    try:
        time.sleep(0.3)  # the child is there before the first reading
        a.idle_s(time.monotonic())
        time.sleep(0.5)  # this process sleeps; its child computes
        assert a.idle_s(time.monotonic()) is None
    finally:
        child.kill()
        child.wait(10)
