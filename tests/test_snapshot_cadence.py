"""Which steps get a snapshot: fixed intervals, and "auto" from measured step times."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from conftest import TRAIN, Procs

from ftrun.errors import ConfigError
from ftrun.rank.snapshotter import Cadence


def test_fixed_interval() -> None:
    c = Cadence(3)
    assert [s for s in range(1, 10) if c.due(s)] == [3, 6, 9]
    assert Cadence("1").k == 1 and not Cadence("4").auto
    for bad in (0, "-2", "often", ""):
        with pytest.raises(ConfigError, match="'auto'"):
            Cadence(bad)


def feed(c: Cadence, steps: int, plain_s: float, copy_s: float) -> None:
    """Run ``steps`` steps: a step after a snapshot takes ``plain_s + copy_s``."""
    for step in range(1, steps + 1):
        c.observe(plain_s + (copy_s if c._last_due else 0.0))
        c.mark(c.due(step))


def test_auto_warms_up_then_keeps_the_slowdown_under_three_percent() -> None:
    c = Cadence("auto", gpu_mtbf_h=0)  # the failure rate ignored: the cost target alone
    assert c.auto and c.k == Cadence.WARMUP_K and c.cost() is None
    feed(c, 12, plain_s=0.100, copy_s=0.015)  # a snapshot costs 15% of a step
    cost, plain = c.cost()
    assert cost == pytest.approx(0.015) and plain == pytest.approx(0.100)
    k = c.wanted()
    assert k == 5  # 15% / 5 = 3%
    assert cost / (k * plain) <= Cadence.TARGET


def test_auto_snapshots_every_step_when_the_copy_is_hidden() -> None:
    c = Cadence("auto")
    feed(c, 12, plain_s=0.2, copy_s=0.0)
    assert c.wanted() == 1
    c.agree(32)  # not distributed: takes its own choice
    assert c.k == 1


def test_a_snapshot_costs_at_least_what_its_step_spent_in_save_and_wait() -> None:
    """On a busy host the steps without a snapshot measured as slow as those with one (a
    cost of 0 asked for a snapshot every step: seen with Lightning at 3.6 ms steps, each
    snapshot 6-9 ms of CPU); the time the training thread itself spent in save() and wait()
    is the floor of the cost."""
    c = Cadence("auto", gpu_mtbf_h=0)  # the cost target alone
    feed(c, 12, plain_s=0.0036, copy_s=0.0)
    assert c.cost() == (0.0, pytest.approx(0.0036)) and c.wanted() == 1
    for _ in range(3):
        c.blocked(0.0016)
    cost, plain = c.cost()
    assert cost == pytest.approx(0.0016)
    assert c.wanted() == 15  # 1.6 ms / 3.6 ms = 44% of a step: 3% takes one in 15
    c.blocked(-1.0)  # (a clock step backwards counts as nothing)
    assert c.cost()[0] == pytest.approx(0.0016)


def test_the_snapshotter_tells_the_cadence_what_each_snapshot_blocked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshotter._due hands the cadence the saver's blocked time of each step that took a
    snapshot (the save() and wait() of that step), and only of those."""
    from types import SimpleNamespace

    from ftrun.rank.snapshotter import Snapshotter

    snap = Snapshotter.__new__(Snapshotter)
    snap.cadence = Cadence("auto", gpu_mtbf_h=0)
    snap._last_save_call = None
    snap._blocked_mark = 0.0
    snap._saver = SimpleNamespace(blocked_s=0.0)
    seen: list[float] = []
    monkeypatch.setattr(snap.cadence, "blocked", seen.append)
    for step in range(1, 7):  # warm-up: every 2nd step is due
        due = snap._due(step)
        snap._saver.blocked_s += 0.005 if due else 0.0001
    assert seen == pytest.approx([0.005, 0.005])  # steps 2 and 4 (6's is told at step 7)


def test_auto_backs_off_where_snapshots_were_given_up_and_stays_there() -> None:
    """The copy looks free (the step after a save is no slower), but the store could not
    keep up at K=2: two snapshots given up. K doubles and does not come back down when the
    step times still say the copy is free."""
    c = Cadence("auto")
    feed(c, 12, plain_s=0.2, copy_s=0.0)
    c.agree(32)
    assert c.k == 1
    c.k = 2
    c.skipped()
    c.skipped()
    c.agree(64)
    assert (c.k, c.floor) == (4, 4)
    feed(c, 40, plain_s=0.2, copy_s=0.0)
    c.agree(96)  # no skip at 4, and the step times still want 1
    assert c.k == 4
    c.skipped()
    c.agree(128)
    assert c.k == 8


def test_auto_snapshots_no_more_often_than_the_failure_rate_makes_worth_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Young's interval: at 16,384 ranks failing at Llama 3's rate (the default), a snapshot
    that costs 0.114 s (an H100's 3.2 GB) is worth taking every ~50 s, not every 8 steps of
    0.5 s as the 3% target alone would; a small job's interval is capped at 60 s."""
    from ftrun.rank.cadence import young_interval_s

    c = Cadence("auto")
    assert c.gpu_mtbf_h == 50700
    feed(c, 12, plain_s=0.5, copy_s=0.114)
    mtbf_s = 50700 * 3600 / 16384
    assert young_interval_s(0.114, 16384, 50700, 60) == pytest.approx((2 * 0.114 * mtbf_s) ** 0.5)
    assert c.wanted(16384) == 100  # floor(50.4 s / 0.5 s)
    target_alone = Cadence("auto", gpu_mtbf_h=0)
    feed(target_alone, 12, plain_s=0.5, copy_s=0.114)
    assert target_alone.wanted(16384) == 8  # ceil(0.114 / (3% of 0.5 s))
    assert c.wanted(1) == 120  # Young's 4,270 s capped at 60 s
    with caplog.at_level("INFO", logger="ftrun.rank.snapshotter"):
        c.agree(32)  # not distributed: a world of 1
    assert c.k == 120 and "Young's interval, at most 60 s" in caplog.text, caplog.text
    # A copy that costs nothing: every step, whatever the failure rate.
    free = Cadence("auto")
    feed(free, 12, plain_s=0.5, copy_s=0.0)
    assert free.wanted(16384) == 1
    monkeypatch.setenv("FTRUN_GPU_MTBF_HOURS", "often")
    with pytest.raises(ConfigError, match="FTRUN_GPU_MTBF_HOURS must be a number of hours"):
        Cadence("auto")


def test_auto_caps_the_interval() -> None:
    c = Cadence("auto")
    feed(c, 12, plain_s=0.001, copy_s=100.0)
    assert c.wanted() == Cadence.MAX_K


@pytest.mark.integration
def test_launcher_interval_and_the_last_step_taken_at_close(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    """--snapshot-every 4 reaches the ranks (train.py's `launcher` defers to it); close() takes
    step 10, which 4 does not divide."""
    persist = tmp_path / "persist"
    proc = procs.ftrun("--standalone", "--rdzv-id", f"cad-{uuid.uuid4().hex[:8]}",
                       "--nproc-per-node", "2", "--snapshot-every", "4", "--persist-dir",
                       str(persist), "--persist-every", "1", "--persist-keep", "10", TRAIN,
                       "--steps", "10", "--layers", "1", "--dim", "32",
                       "--snapshot-every", "launcher")
    assert procs.wait(proc, 240) == 0, procs.output(proc)[-4000:]
    steps = sorted(int(p.name.split("_")[1]) for p in persist.iterdir() if p.name.startswith("step_"))
    assert steps[-1] == 10 and set(steps) <= {4, 8, 10}, steps


def test_status_names_the_interval_and_what_skips_cost() -> None:
    from ftrun.cli.status import _cadence_text

    assert _cadence_text({}) == ""
    assert _cadence_text({"every": 1, "effective_every": 1.0}) == " | every 1 step(s)"
    assert _cadence_text({"every": 2, "effective_every": 3.5}) == \
        " | every 2 step(s), effective 3.5"


def test_skipped_snapshots_are_counted_with_their_reasons_and_told_since_the_last_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """The warning says how many were skipped since its last line and in all (not a count
    frozen at the first); the closing summary counts them by reason."""
    import logging

    from ftrun.rank import save

    # Only the counting is exercised: no rank context, no state, no copy thread started.
    saver = save.Saver(None, None, Cadence(1), async_copy=True,  # type: ignore[arg-type]
                       wait_s=0.0)
    saver.taken_saves = 10
    with caplog.at_level(logging.WARNING, logger=save.log.name):
        saver.skipped(3, "the store was busy", "store_busy")
        saver.skipped(4, "the store was busy", "store_busy")  # within the interval: not logged
        saver.skipped(5, "no buffer", "no_buffer")
        saver._skip_logged -= save.SKIP_LOG_INTERVAL_S  # the interval has passed
        saver.skipped(6, "no forward pass", "no_forward")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "step 3: the store was busy (1 skipped since the last such line; 1 of 10" in lines[0]
    assert "step 6: no forward pass (3 skipped since the last such line; 4 of 10" in lines[1]
    assert saver.summary() == ("6 of 10 snapshots staged, 4 skipped (2 store_busy, "
                               "1 no_buffer, 1 no_forward)")
