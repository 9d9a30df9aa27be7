"""``ftrun status`` after a job's end and ``ftrun report``: unit tests on hand-written event
logs, and one real 3-rank job with two injected faults (a kill, then a raise) whose status
and report are read after its end, with no coordinator left to ask."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TRAIN, Procs, read_events

from ftrun import exit_codes
from ftrun.cli import history as hist
from ftrun.cli.report import run_report
from ftrun.cli.status import render_status, run_status

T0 = 1_800_000_000.0


def _ev(seq: int, dt: float, type_: str, node: str | None = "h1/100", **data: Any) -> dict:
    return {**data, "seq": seq, "ts": T0 + dt, "type": type_, "node": node}


def _log(end: dict | None = None) -> list[dict]:
    """One node, 3 ranks: rank 1 killed at +20 s, recovered in place, resumed from step 11;
    rank 2 raised at +40 s, in place failed, new processes, resumed from step 25."""
    events = [
        _ev(1, 0.0, "job_start", None, run_id="r"),
        _ev(2, 0.1, "node_joined", host="h1"),
        _ev(3, 0.5, "rendezvous", duration_s=0.3),
        _ev(4, 0.6, "workers_started"),
        _ev(5, 5.0, "restore", step=0, source="none"),
        _ev(6, 20.1, "worker_failure", rank=1, pid=7, signal="SIGKILL",
            message="rank 1 died (SIGKILL)", timestamp=T0 + 20.0),
        _ev(7, 20.1, "restart", restart_count=1),
        _ev(8, 20.4, "rendezvous", duration_s=0.1),
        _ev(9, 20.5, "recovery", how="in_process", detect_s=0.1, abort_s=0.2,
            rendezvous_s=0.1, world_s=0.1, total_s=0.5, new_processes=[1], kept=[0, 2]),
        _ev(10, 22.0, "restore", step=11, source="memory"),
        _ev(11, 40.05, "worker_failure", rank=2, message="ValueError: x", timestamp=T0 + 40.0),
        _ev(12, 43.0, "rendezvous", duration_s=0.5),
        _ev(13, 44.0, "recovery", how="fallback", fallback_reason="local rank 0 did not "
            "acknowledge", detect_s=0.05, in_place_s=3.0, restart_s=0.95, total_s=4.0),
        _ev(14, 50.0, "restore", step=25, source="memory"),
        _ev(15, 60.0, "persist_skipped", step=28, writing=["h1/100"]),
    ]
    if end is not None:
        events += [_ev(16, 70.0, "job_end", **end),
                   _ev(17, 70.0, "node_left", state=end["state"], exitcode=end["exitcode"])]
    return events


def test_history_pairs_each_failure_with_its_recovery_and_restore() -> None:
    h = hist.job_history(_log({"exitcode": 0, "state": "succeeded"}))
    assert (h["ended"], h["outcome"], h["exitcode"], h["wall_s"]) == (True, "succeeded", 0, 70.0)
    one, two = h["faults"]
    assert (one["ranks"], one["kind"], one["resumed_from"], one["restored_from"]) == \
        ([1], "rank_crash", 11, "memory")
    assert one["detected_after_s"] == 0.1 and one["recovery_s"] == 0.5
    assert one["recovered_after_s"] == pytest.approx(2.0) and one["restore_s"] == \
        pytest.approx(1.5)
    assert two["recovery"]["how"] == "fallback" and two["resumed_from"] == 25
    assert two["recovered_after_s"] == pytest.approx(10.0)
    # No event carries the step a rank failed in: steps lost are not made up.
    assert one["steps_lost"] is None and two["steps_lost"] is None
    assert h["persist_skipped"] == [28] and h["steps_trained"] is None


def test_steps_trained_and_skipped_snapshots_come_from_the_end_events() -> None:
    """Steps trained: the largest last_step of the nodes' job_end; snapshots skipped: the
    sum of each node's last count (node_left); only what a log lacks is listed missing."""
    events = _log({"exitcode": 0, "state": "succeeded", "last_step": 40})
    n = len(events)
    events += [_ev(n + 1, 70.0, "node_left", "h1/100", state="succeeded", snapshots_skipped=3,
                   snapshot_blocked_s=1.25),
               _ev(n + 2, 70.0, "node_left", "h2/200", state="succeeded", snapshots_skipped=0,
                   snapshot_blocked_s=2.0)]
    h = hist.job_history(events)
    assert (h["steps_trained"], h["snapshots_skipped"]) == (40, 3)
    # Ranks are held at once (a step waits for the slowest): the most any node reported.
    assert h["snapshot_blocked_s"] == 2.0
    split = hist.time_split(events, h)
    assert split["snapshot_blocked_s"] == 2.0
    parts = [v for k, v in split.items() if k.endswith("_s") and k != "wall_s" and v is not None]
    assert sum(parts) == pytest.approx(70.0, abs=0.01)
    missing = hist.missing(h)
    assert "steps_trained" not in missing and "snapshot_skips" not in missing
    assert "snapshot_blocked" not in missing
    assert "fault_step" in missing  # these failures carry none
    assert set(hist.missing(hist.job_history(_log({"exitcode": 0, "state": "succeeded"})))) >= {
        "steps_trained", "snapshot_skips"}


def test_a_rank_s_skips_are_counted_over_its_restarts() -> None:
    """A store adds a rank's counts up across its Snapshotters (each starts from 0)."""
    from ftrun.store.handlers import RankTally

    skips = RankTally()
    assert [skips.add(0, c) for c in (0, 2, 5)] == [0, 2, 5]
    assert skips.add(1, 4) == 4  # another rank: its own count
    assert [skips.add(0, c) for c in (0, 1, 3)] == [5, 6, 8]  # restarted: 5 before
    assert skips.add(0, 1) == 9  # and again (3 before this one)
    # With the Snapshotter's identity, a restart is seen even when the count did not drop.
    known = RankTally()
    assert [known.add(0, c, who) for c, who in ((2, "a"), (2, "b"), (3, "b"))] == [2, 4, 5]


def test_skips_by_reason_are_counted_over_restarts_and_shown() -> None:
    """By reason, the same: a reason a restarted rank has not counted yet is 0 for it; the
    nodes' counts (node_left) add up in the history, and status/report say them."""
    from ftrun.store.handlers import ReasonTally

    reasons = ReasonTally()
    reasons.add(0, {"store_busy": 2}, "a")
    reasons.add(0, {"store_busy": 3, "no_buffer": 1}, "a")
    reasons.add(1, {"no_forward": 1}, "c")
    reasons.add(0, {"no_buffer": 1}, "b")  # restarted: store_busy 0 so far, no_buffer 1 again
    reasons.add(0, {"store_busy": 2, "no_buffer": 1}, "b")
    assert reasons.totals() == {"store_busy": 5, "no_buffer": 2, "no_forward": 1}

    events = _log({"exitcode": 0, "state": "succeeded"})
    n = len(events)
    events += [_ev(n + 1, 70.0, "node_left", "h1/100", state="succeeded", snapshots_skipped=3,
                   snapshot_skip_reasons={"store_busy": 2, "no_forward": 1}),
               _ev(n + 2, 70.0, "node_left", "h2/200", state="succeeded", snapshots_skipped=1,
                   snapshot_skip_reasons={"store_busy": 1})]
    h = hist.job_history(events)
    assert h["snapshots_skipped"] == 4
    assert h["snapshot_skip_reasons"] == {"store_busy": 3, "no_forward": 1}
    assert hist.reasons_text(h["snapshot_skip_reasons"]) == " (3 store_busy, 1 no_forward)"


def test_a_failure_event_with_a_step_gives_the_steps_lost() -> None:
    events = _log({"exitcode": 0, "state": "succeeded"})
    events[5]["step"] = 12
    assert hist.job_history(events)["faults"][0]["steps_lost"] == 1


def test_a_lost_node_is_recovered_by_the_others_and_one_node_failing_twice_is_one_fault() -> None:
    events = [
        _ev(1, 0.0, "job_start", None),
        _ev(2, 10.0, "node_lost", "h2/200", silent_s=10.0),
        _ev(3, 11.0, "worker_failure", rank=0, message="rank 0 died", timestamp=T0 + 11.0),
        _ev(4, 11.1, "worker_failure", rank=1, message="rank 1 died", timestamp=T0 + 11.1),
        _ev(5, 14.0, "recovery", how="new_process", detect_s=0.2, restart_s=2.0, total_s=3.0),
        _ev(6, 15.0, "recovery", "h3/300", how="new_process", detect_s=0.1, total_s=4.0),
        _ev(7, 20.0, "restore", step=40, source="memory"),
    ]
    faults = hist.job_history(events, now=T0 + 30.0)["faults"]
    assert [(f["kind"], f["node"], f["ranks"]) for f in faults] == [
        ("host_loss", "h2/200", []), ("rank_crash", "h1/100", [0, 1])]
    lost, crash = faults
    assert lost["recovery_s"] == 4.0 and lost["host"] == "h2"  # by h3's recovery
    assert crash["recovery_s"] == 3.0
    assert lost["resumed_from"] == crash["resumed_from"] == 40


def test_a_hung_rank_s_fault_step_comes_from_its_suspect_event() -> None:
    events = _log({"exitcode": 0, "state": "succeeded"})
    events.insert(5, _ev(40, 18.0, "rank_suspect", rank=1, cause="stopped", step=13))
    events.insert(6, _ev(41, 19.0, "rank_suspect", rank=2, cause="stopped", step=13))
    events.insert(7, _ev(42, 19.5, "rank_cleared", rank=2, cause="stopped", step=13))
    events[8] = _ev(6, 20.1, "hang_detected", rank=1, reason="stopped", timestamp=T0 + 20.0)
    one, two = hist.job_history(events)["faults"]
    assert (one["kind"], one["fault_step"], one["resumed_from"], one["steps_lost"]) == \
        ("hang", 13, 11, 2)
    assert two["fault_step"] is None  # rank 2 was cleared: its old step is not its fault's


def test_time_split_sums_to_the_wall_time() -> None:
    events = _log({"exitcode": 0, "state": "succeeded"})
    split = hist.time_split(events, hist.job_history(events))
    # Rendezvous inside a recovery is in its phases, not counted twice as waiting.
    assert split["rendezvous_wait_s"] == pytest.approx(0.3)
    assert split["startup_s"] == pytest.approx(5.0 - 0.3)
    assert split["detection_s"] == pytest.approx(0.15)
    assert split["recovery_in_place_attempt_s"] == pytest.approx(3.0)
    assert split["restore_s"] == pytest.approx(1.5 + 6.0)
    parts = [v for k, v in split.items() if k.endswith("_s") and k != "wall_s" and v is not None]
    assert sum(parts) == pytest.approx(70.0, abs=0.01)
    assert split["snapshot_blocked_s"] is None and split["recompute_s"] is None
    assert split["ettr"] == pytest.approx(split["training_s"] / 70.0, abs=1e-4)


def test_recomputed_steps_cost_the_steps_lost_at_the_job_s_step_time() -> None:
    """With the fault steps and the step time recorded, the recomputed steps are counted out
    of training: (12 - 11) + (27 - 25) steps at 0.5 s."""
    events = _log({"exitcode": 0, "state": "succeeded", "step_s": 0.5})
    events[5]["step"], events[10]["step"] = 12, 27
    history = hist.job_history(events)
    split = hist.time_split(events, history)
    assert history["step_s"] == 0.5 and "step_time" not in hist.missing(history)
    assert split["recompute_s"] == pytest.approx(1.5)
    parts = [v for k, v in split.items() if k.endswith("_s") and k != "wall_s" and v is not None]
    assert sum(parts) == pytest.approx(70.0, abs=0.01)


def test_projection_uses_bench_ettr_with_the_measured_costs() -> None:
    doc = hist.report(_log({"exitcode": 0, "state": "succeeded"}), "r")
    proj = doc["projected"]
    assert proj["faults"] == 2
    # Each fault costs the model its measured kind's mean: (2.0 + 10.0) s down in all.
    assert proj["detection_s"] + proj["recovery_s"] == pytest.approx(12.0, abs=0.01)
    assert proj["ettr"] == pytest.approx((70.0 - 12.0) / 70.0, abs=1e-3)
    assert doc["version"] == hist.REPORT_VERSION and "fault_step" in doc["missing"]


# -- snapshot commits, batched into events ----------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_commit_batch_is_drained_at_most_every_30_s_unless_forced() -> None:
    from ftrun.coordinator.commits import COMMITS_EVENT_EVERY_S, CommitBatch

    clock = _Clock()
    batch = CommitBatch(clock=clock)
    assert batch.drain(force=True) is None  # nothing committed: no event
    batch.add(1, T0 + 1.0)
    batch.add(2, T0 + 2.0)
    assert batch.drain() is None  # too soon after the last one
    clock.now += COMMITS_EVENT_EVERY_S
    assert batch.drain() == {"commits": [[1, T0 + 1.0], [2, T0 + 2.0]], "count": 2,
                             "dropped": 0}
    batch.add(3, T0 + 3.0)
    assert batch.drain() is None
    # Before a failure or the end: whatever came, at once.
    assert batch.drain(force=True) == {"commits": [[3, T0 + 3.0]], "count": 1, "dropped": 0}
    assert batch.drain(force=True) is None


@pytest.mark.parametrize("n", [7, 8, 9, 100, 1001])
def test_a_long_batch_is_thinned_evenly_keeping_the_first_and_the_newest(n: int) -> None:
    from ftrun.coordinator.commits import CommitBatch

    batch = CommitBatch(limit=8, clock=_Clock())
    for step in range(1, n + 1):
        batch.add(step, T0 + step)
    out = batch.drain(force=True)
    assert out is not None
    steps = [c[0] for c in out["commits"]]
    assert len(steps) <= 8 and out["count"] == n and out["dropped"] == n - len(steps)
    assert steps[0] == 1 and steps[-1] == n and steps == sorted(steps)
    # Evenly: one stride between all the kept ones but the newest (kept apart).
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1], strict=True)}
    assert len(gaps) <= 1, steps
    assert [c[1] for c in out["commits"]] == [T0 + s for s in steps]


def test_the_tracker_batches_each_commit_with_its_time() -> None:
    from ftrun.coordinator.commits import CommitTracker

    tracker = CommitTracker()
    tracker.begin("e", base_step=0, world_size=2)
    tracker.verified("e", 0, 1, 10)
    assert tracker.commit_batch.drain(force=True) is None  # one rank: not committed
    for step, rank in ((1, 1), (2, 0), (2, 1)):
        tracker.verified("e", rank, step, 10)
    out = tracker.commit_batch.drain(force=True)
    assert out is not None and [c[0] for c in out["commits"]] == [1, 2]
    assert out["commits"][1][1] == pytest.approx(tracker.get("e").committed_at, abs=1e-3)


def test_the_coordinator_records_the_commits_before_a_failure_and_at_its_end(
        tmp_path: Path) -> None:
    """Commits come in a batch event; a failure first flushes the batch (the report places
    the commits before it), and so does stopping the coordinator."""
    from ftrun.coordinator.server import Coordinator

    log = tmp_path / "events.jsonl"
    c = Coordinator("job", b"0123456789abcdef0123456789abcdef", bind_host="127.0.0.1",
                    events_file=log)
    c.start()
    try:
        snap = c._snapshots  # the stores' messages, handled as the service hands them over
        snap._commit("snap_epoch", {"node_id": "n", "epoch": "e", "base_step": 0,
                                    "world_size": 1, "source": "none"})
        for step in (1, 2, 3):
            snap._commit("snap_verified", {"node_id": "n", "epoch": "e", "rank": 0,
                                           "step": step, "nbytes": 10})
        assert [e["type"] for e in c.events()][-1] == "restore"  # batched, not one per step
        c.record_event("worker_failure", "n", rank=0, message="rank 0 died")
        *_, batch, failure = c.events()
        assert (batch["type"], failure["type"]) == ("snapshots_committed", "worker_failure")
        assert [s for s, _ in batch["commits"]] == [1, 2, 3] and batch["count"] == 3
        snap._commit("snap_verified", {"node_id": "n", "epoch": "e", "rank": 0, "step": 4,
                                       "nbytes": 10})
    finally:
        c.stop(timeout_s=2)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["type"] == "snapshots_committed" and events[-1]["commits"][0][0] == 4
    h = hist.job_history(events, now=events[-1]["ts"])
    assert [c["step"] for c in h["snapshot_commits"]] == [1, 2, 3, 4]
    assert h["snapshots_committed"] == 4 and h["last_commit"]["step"] == 4


def test_a_coordinator_that_stepped_down_records_no_commit_after(tmp_path: Path) -> None:
    """Stepped down (another holds the role), a coordinator records only that: the commits it
    had batched are not flushed as it stops."""
    from ftrun.coordinator.server import Coordinator

    log = tmp_path / "events.jsonl"
    c = Coordinator("job", b"0123456789abcdef0123456789abcdef", bind_host="127.0.0.1",
                    events_file=log)
    c.start()
    try:
        snap = c._snapshots
        snap._commit("snap_epoch", {"node_id": "n", "epoch": "e", "base_step": 0,
                                    "world_size": 1, "source": "none"})
        snap._commit("snap_verified", {"node_id": "n", "epoch": "e", "rank": 0, "step": 1,
                                       "nbytes": 10})
        c.step_down("a test")
    finally:
        c.stop(timeout_s=2)
    types = [json.loads(line)["type"] for line in log.read_text().splitlines()]
    assert types[-1] == "coordinator_stepped_down" and "snapshots_committed" not in types


def test_commits_in_the_history_text_and_page(
        state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _log({"exitcode": 0, "state": "succeeded"})
    n = len(events)
    # Two batches, the second thinned (10 commits, 3 listed).
    events.insert(9, _ev(n + 1, 20.1, "snapshots_committed", None, count=3, dropped=0,
                         commits=[[9, T0 + 15.0], [10, T0 + 17.5], [11, T0 + 19.0]]))
    events.insert(-2, _ev(n + 2, 70.0, "snapshots_committed", None, count=10, dropped=7,
                          commits=[[26, T0 + 51.0], [30, T0 + 60.0], [35, T0 + 69.0]]))
    h = hist.job_history(events)
    assert [c["step"] for c in h["snapshot_commits"]] == [9, 10, 11, 26, 30, 35]
    assert (h["snapshots_committed"], h["snapshot_commits_unlisted"]) == (13, 7)
    assert h["last_commit"] == {"at": T0 + 69.0, "step": 35}
    assert "snapshot_commits" not in hist.missing(h)
    assert "snapshot_commits" in hist.missing(hist.job_history(_log()))
    _job(state_dir, "r", events)
    assert run_report("r", json_out=False, state_dir=None) == exit_codes.OK
    assert "snapshots committed: 13, the last step 35 at +69.0 s" in capsys.readouterr().out
    page = tmp_path / "r.html"
    assert run_report("r", json_out=False, state_dir=None, html=str(page)) == exit_codes.OK
    html = page.read_text()
    assert html.count('<line class="commit"') == 6
    assert "<title>committed step 10 at +17.50 s</title>" in html
    assert "snapshot committed" in html  # its legend entry
    assert "13 commit(s), 6 marked" in html


# -- spares -------------------------------------------------------------------------------------


def _spare_log() -> list[dict]:
    """h1 and h2 train from +1 s; h3 joins at +5 s and waits as the spare; h2 is lost at
    +20 s and h3 takes over at +24 s; h4 joins at +30 s and waits until the end (+60 s)."""
    return [
        _ev(1, 0.0, "job_start", None),
        _ev(2, 0.1, "node_joined", "h1/1"), _ev(3, 0.1, "node_joined", "h2/2"),
        _ev(4, 0.8, "rendezvous", "h1/1", duration_s=0.6),
        _ev(5, 0.8, "rendezvous", "h2/2", duration_s=0.6),
        _ev(6, 1.0, "restore", "h1/1", step=0, source="none"),
        _ev(7, 5.0, "node_joined", "h3/3"),
        _ev(8, 20.0, "node_lost", "h2/2", silent_s=3.0),
        _ev(9, 24.0, "rendezvous", "h1/1", duration_s=3.0),
        _ev(10, 24.0, "rendezvous", "h3/3", duration_s=18.9),
        _ev(11, 25.0, "recovery", "h1/1", how="new_process", detect_s=0.5, rendezvous_s=3.0,
            total_s=4.5),
        _ev(12, 26.0, "restore", "h1/1", step=40, source="memory"),
        _ev(13, 30.0, "node_joined", "h4/4"),
        _ev(14, 60.0, "job_end", "h1/1", exitcode=0, state="succeeded"),
        _ev(15, 60.0, "node_left", "h1/1", exitcode=0, state="succeeded"),
        _ev(16, 60.0, "job_end", "h3/3", exitcode=0, state="succeeded"),
        _ev(17, 60.0, "node_left", "h3/3", exitcode=0, state="succeeded"),
        _ev(18, 60.5, "node_left", "h4/4", exitcode=0, state="succeeded"),
    ]


def test_spare_waiting_is_its_own_line_beside_the_wall_time(
        state_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line each (narrower, they wrap: never cut)
    events = _spare_log()
    h = hist.job_history(events)
    assert [(s["node"], s["took_over_at"], s["waited_s"]) for s in h["spares"]] == [
        ("h3/3", T0 + 24.0, pytest.approx(18.9)), ("h4/4", None, pytest.approx(30.5))]
    assert h["spares"][0]["waited_from"] == pytest.approx(T0 + 5.1)
    split = hist.time_split(events, h)
    assert split["beside"] == {"spare_wait_s": pytest.approx(49.4), "spares": 2,
                               "spares_never_took_over": 1}
    # The job's own parts still make its wall time: the spares waited beside it.
    parts = [v for k, v in split.items() if k.endswith("_s") and k != "wall_s" and v is not None]
    assert sum(parts) == pytest.approx(split["wall_s"], abs=0.01)
    assert hist.job_history(_log())["spares"] == []  # one node, in the first world
    # A spare that joined without a fault (a late node the job grew to take) waited beside
    # the job all the same: its rendezvous is not the job's waiting.
    late = [e for e in events if e["type"] not in ("node_lost", "recovery")]
    split = hist.time_split(late, hist.job_history(late))
    assert split["rendezvous_wait_s"] == pytest.approx(1.2 + 3.0)  # h1's rounds, not h3's
    assert split["beside"]["spare_wait_s"] == pytest.approx(49.4)
    _job(state_dir, "r", events)
    assert run_report("r", json_out=False, state_dir=None) == exit_codes.OK
    text = capsys.readouterr().out
    assert "spares waiting (2 launcher(s), 1 never took over; beside the wall time)" in text
    assert "49.40" in text


@pytest.mark.parametrize(("states", "outcome", "exitcode"), [
    ([("succeeded", 0), ("succeeded", 0)], "succeeded", 0),
    ([("succeeded", 0), ("isolated", 8)], "succeeded", 0),
    ([("stopped", 143)], "stopped", 143),
    ([("stopped", 143), ("failed", 1)], "failed", 143),
])
def test_outcome_of_every_node_s_end(states: list[tuple[str, int]], outcome: str,
                                     exitcode: int) -> None:
    events = [_ev(1, 0.0, "job_start", None)]
    for i, (state, code) in enumerate(states):
        events += [_ev(2 + 3 * i, 1.0, "node_joined", f"h{i}/1"),
                   _ev(3 + 3 * i, 9.0, "job_end", f"h{i}/1", exitcode=code, state=state),
                   _ev(4 + 3 * i, 9.0, "node_left", f"h{i}/1", exitcode=code, state=state)]
    h = hist.job_history(events)
    assert (h["ended"], h["outcome"], h["exitcode"]) == (True, outcome, exitcode)
    one_left = hist.job_history(events[:-1]) if len(states) > 1 else None
    if one_left is not None:  # a node has not left yet: the job still runs
        assert not one_left["ended"]


def test_a_live_or_killed_job_is_not_taken_for_a_finished_one() -> None:
    running = hist.job_history(_log(), now=T0 + 65.0)
    assert (running["ended"], running["outcome"], running["wall_s"]) == (False, "running", 65.0)
    killed = hist.job_history(_log(), gone=True)
    assert (killed["ended"], killed["outcome"], killed["exitcode"]) == (True, "killed", None)


def test_a_live_status_shows_the_history_section() -> None:
    from rich.console import Console

    doc = {"run_id": "r", "health": "degraded", "nodes": [], "summary": {"nodes": 0},
           "history": hist.job_history(_log(), now=T0 + 65.0)}
    console = Console(width=200, record=True)
    console.print(render_status(doc, no_headers=False))
    text = console.export_text()
    assert "job r: degraded" in text and "resumed from step 25 (memory)" in text
    assert "ended" not in text  # the job line is the live one, not the history's


def _job(state: Path, run_id: str, events: list[dict] | None) -> None:
    """A job file whose coordinator process is gone (a pid that has exited), and its log."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    d = state / "jobs" / run_id
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({
        "run_id": run_id, "endpoint": "127.0.0.1:9", "host": socket.gethostname(),
        "pid": int(done.stdout), "started_at": T0}))
    if events is not None:
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.mark.parametrize(("end", "code", "health"), [
    ({"exitcode": 0, "state": "succeeded"}, exit_codes.OK, "finished"),
    ({"exitcode": 1, "state": "failed"}, exit_codes.JOB_FAILED, "failed"),
    (None, exit_codes.JOB_FAILED, "failed"),  # killed: no job_end
    ({"exitcode": 143, "state": "stopped"}, exit_codes.JOB_FAILED, "failed"),  # SIGTERM
])
def test_status_of_an_ended_job_answers_from_its_log(
        state_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        end: dict | None, code: int, health: str) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line each (narrower, they wrap: never cut)
    _job(state_dir, "r", _log(end))
    # The job file names no coordinator that answers: the document is the event log's.
    assert run_status("r", endpoint=None, json_out=True, watch=False, no_headers=False,
                      state_dir=None, timeout_s=30.0) == code
    doc = json.loads(capsys.readouterr().out)
    assert (doc["version"], doc["ended"], doc["health"]) == (hist.HISTORY_VERSION, True, health)
    assert [f["resumed_from"] for f in doc["history"]["faults"]] == [11, 25]
    assert run_status("r", endpoint=None, json_out=False, watch=False, no_headers=False,
                      state_dir=None) == code
    text = capsys.readouterr().out
    assert "resumed from step 11 (memory)" in text and "rank 1 died (SIGKILL)" in text
    assert "steps recomputed: not recorded" in text


def test_bad_input_says_what_to_do(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_report("nope", json_out=False, state_dir=None) == exit_codes.NOT_FOUND
    assert "list jobs with `ftrun status`" in capsys.readouterr().err
    _job(state_dir, "nolog", None)
    assert run_report("nolog", json_out=False, state_dir=None) == exit_codes.FAILED
    err = capsys.readouterr().err
    assert "has no event log" in err and "--state-dir" in err
    assert run_status("nolog", endpoint=None, json_out=False, watch=False, no_headers=False,
                      state_dir=None) == exit_codes.FAILED
    assert "has no event log" in capsys.readouterr().err


def test_report_text_names_every_part_and_what_is_not_recorded(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _job(state_dir, "r", _log({"exitcode": 0, "state": "succeeded"}))
    assert run_report("r", json_out=False, state_dir=None) == exit_codes.OK
    text = capsys.readouterr().out
    for word in ("detection", "recovery: abort", "recovery: in-place attempt", "training",
                 "wall time", "effective training time ratio", "projected by bench/ettr.py",
                 "new processes (in place failed)", "not recorded in the event log"):
        assert word in text, word


def test_html_is_one_self_contained_page_with_the_timeline(
        state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = _log({"exitcode": 0, "state": "succeeded"})
    events[10]["message"] = "ValueError: <script>alert(1)</script>"
    events.insert(14, _ev(30, 55.0, "persist_target", step=27, reason="every 10 steps"))
    _job(state_dir, "r", events)
    page = tmp_path / "r.html"
    assert run_report("r", json_out=False, state_dir=None, html=str(page)) == exit_codes.OK
    assert str(page) in capsys.readouterr().out
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 1
    assert "<script" not in html and "&lt;script&gt;" in html  # texts are escaped
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no network
    assert "<title>fault 1: rank_crash" in html and "<title>fault 2: rank_crash" in html
    for step, source in ((0, "none"), (11, "memory"), (25, "memory")):
        assert f"<title>restored step {step} from {source}</title>" in html
    assert "<title>persist target: step 27</title>" in html
    assert "fault 2: restore 6.00 s" in html  # the band from recovery to restore
    assert run_report("r", json_out=False, state_dir=None,
                      html=str(tmp_path / "no" / "dir.html")) == exit_codes.USAGE
    assert "pick a writable path" in capsys.readouterr().err


# -- one real job ---------------------------------------------------------------------------

FAULTS = [{"step": 6, "rank": 1, "mode": "kill"}, {"step": 14, "rank": 2, "mode": "raise"}]


@pytest.fixture(scope="module")
def ended_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 3-rank standalone job of 20 steps, rank 1 killed in step 6 and rank 2 raising in
    step 14; run to its end."""
    tmp = tmp_path_factory.mktemp("report")
    state = tmp / "state"
    run_id = f"report-{uuid.uuid4().hex[:8]}"
    schedule = tmp / "faults.json"
    schedule.write_text(json.dumps(FAULTS))
    # Each step waits for its snapshot's buffer (as the exact_steps fixture): the step
    # resumed from is then the one before the fault, or the one before that when the
    # fault came as the snapshot was still in flight.
    env = {"FTRUN_STATE_DIR": str(state), "FTRUN_SNAPSHOT_WAIT": "60"}
    procs = Procs(tmp)
    try:
        job = procs.ftrun("--standalone", "--rdzv-id", run_id, "--nproc-per-node", "3",
                          "--max-restarts", "3", TRAIN, "--steps", "20", "--snapshot-every",
                          "1", "--fault-schedule", str(schedule), env=env)
        assert procs.wait(job, 240) == 0, procs.output(job)[-4000:]
    finally:
        procs.cleanup()
    for f in FAULTS:
        marker = state / "jobs" / run_id / f"fault-fired-rank{f['rank']}-step{f['step']}"
        assert marker.exists(), f"the fault never fired: {marker} is missing"
    return {"state": state, "run_id": run_id, "env": env, "events": read_events(state, run_id)}


def _ftrun(job: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "ftrun", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, **job["env"]})


@pytest.mark.integration
def test_status_after_the_end_needs_no_coordinator(ended_job: dict[str, Any]) -> None:
    # The job's coordinator is gone: the document comes from the event log.
    out = _ftrun(ended_job, "status", ended_job["run_id"], "--timeout", "30", "--json")
    assert out.returncode == exit_codes.OK, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ended"] and doc["health"] == "finished"
    h = doc["history"]
    assert (h["outcome"], h["exitcode"]) == ("succeeded", 0)
    rows = {tuple(f["ranks"]): f for f in h["faults"]}
    kill, fail = rows[(1,)], rows[(2,)]
    assert "SIGKILL" in kill["what"] and "injected fault" in fail["what"]
    for row, f in ((kill, FAULTS[0]), (fail, FAULTS[1])):
        assert row["recovery"] is not None and row["restored_from"] == "memory"
        # The step the rank failed in is recorded (from its progress: the one after the
        # last it finished) and is the step the fault was injected in; steps lost = that
        # step - the step resumed from.
        assert row["fault_step"] == f["step"], (f, row)
        assert row["steps_lost"] == f["step"] - row["resumed_from"] and \
            row["steps_lost"] in (1, 2), (f, row)
    assert h["steps_trained"] == 20 and "steps_trained" not in doc["missing"]
    assert isinstance(h["snapshots_skipped"], int), h["snapshots_skipped"]
    assert h["step_s"] is not None and h["step_s"] > 0, h["step_s"]
    # Every step was snapshotted: the time that held the ranks was measured (and is > 0).
    assert h["snapshot_blocked_s"] is not None and h["snapshot_blocked_s"] > 0
    assert "fault_step" not in doc["missing"]
    text = _ftrun(ended_job, "status", ended_job["run_id"])
    assert text.returncode == 0 and "ended, succeeded (exit code 0)" in text.stdout
    assert f"resumed from step {kill['resumed_from']} (memory)" in text.stdout


@pytest.mark.integration
def test_report_matches_the_events(ended_job: dict[str, Any]) -> None:
    out = _ftrun(ended_job, "report", ended_job["run_id"], "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["version"] == hist.REPORT_VERSION
    events = ended_job["events"]
    recoveries = [e for e in events if e["type"] == "recovery"]
    failures = [e for e in events if e["type"] == "worker_failure"]
    faults = doc["history"]["faults"]
    assert len(faults) == len(failures) == len(recoveries) >= 2
    for row, failure, rec in zip(faults, failures, recoveries, strict=True):
        assert row["ranks"] == [failure["rank"]]
        assert row["detected_after_s"] == rec["detect_s"]
        assert row["recovery_s"] == rec["total_s"]
        assert row["recovery"]["how"] == rec["how"]
    split = doc["time"]
    start = next(e["ts"] for e in events if e["type"] == "job_start")
    end = next(e["ts"] for e in events if e["type"] == "job_end")
    assert split["wall_s"] == pytest.approx(end - start, abs=1e-3)
    parts = [v for k, v in split.items() if k.endswith("_s") and k != "wall_s" and v is not None]
    assert all(0 <= v <= split["wall_s"] for v in parts)
    assert sum(parts) == pytest.approx(split["wall_s"], abs=0.01)
    assert split["detection_s"] == pytest.approx(sum(r["detect_s"] for r in recoveries),
                                                 abs=1e-3)
    # The recomputed steps: the steps lost at the job's step time (both recorded).
    lost = sum(f["steps_lost"] for f in doc["history"]["faults"])
    assert split["recompute_s"] == pytest.approx(lost * doc["history"]["step_s"], abs=1e-3)
    assert 0 < split["ettr"] < 1 and 0 < doc["projected"]["ettr"] <= 1
    text = _ftrun(ended_job, "report", ended_job["run_id"])
    assert text.returncode == 0 and "effective training time ratio" in text.stdout
    page = ended_job["state"].parent / "report.html"
    out = _ftrun(ended_job, "report", ended_job["run_id"], "--html", str(page))
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert all(f"<title>fault {f['n']}: rank_crash" in html for f in faults)
    # Snapshot commits: batched into events, each batch recorded before the failure after it.
    commits = doc["history"]["snapshot_commits"]
    batches = [e for e in events if e["type"] == "snapshots_committed"]
    assert batches and doc["history"]["snapshots_committed"] == sum(e["count"] for e in batches)
    assert [c["step"] for c in commits] == sorted(c["step"] for c in commits)
    assert commits[-1]["step"] == 20 and "snapshot_commits" not in doc["missing"]
    for f in faults:  # the commits before each fault reach its resumed-from step
        before = [c["step"] for c in commits if c["at"] <= f["at"]]
        assert before and max(before) >= f["resumed_from"], (f, before)
    assert html.count('<line class="commit"') == len(commits)
    assert f"<title>committed step {commits[-1]['step']} at +" in html


# -- the page in a real browser ---------------------------------------------------------------


def _chromium() -> str:
    """Debian's chromium (scripts/setup-chromium.sh); skips without it, fails under
    FTRUN_REQUIRE_CHROMIUM=1 (CI)."""
    import os
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("FTRUN_REQUIRE_CHROMIUM") == "1":
            raise AssertionError("FTRUN_REQUIRE_CHROMIUM=1 but no chromium on PATH: run "
                                 "bash scripts/setup-chromium.sh")
        pytest.skip("no chromium (bash scripts/setup-chromium.sh installs it; "
                    "FTRUN_REQUIRE_CHROMIUM=1 makes this a failure)")
    return path


def _browse(browser: str, profile: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    """Run headless chromium on ``page``; its whole process group is ended on a timeout."""
    import os
    import signal

    proc = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", "--window-size=1400,1000", *args,
         page.as_uri()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise AssertionError(f"chromium did not finish with {page} within 90 s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.integration
def test_the_html_page_renders_in_a_headless_browser(ended_job: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """The real job's page, rendered by chromium: its DOM holds the timeline with a mark per
    fault and per snapshot commit, nothing is logged to the console, and the picture is drawn (the screenshot
    differs from the same page without it)."""
    import re

    browser = _chromium()
    page = tmp_path / "report.html"
    out = _ftrun(ended_job, "report", ended_job["run_id"], "--html", str(page))
    assert out.returncode == 0, out.stderr
    dom = _browse(browser, tmp_path / "profile", page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert dom.stdout.count("<svg") == 1, dom.stdout[:3000]
    assert len(set(re.findall(r"<title>fault (\d+): rank_crash", dom.stdout))) == len(FAULTS)
    # A mark per snapshot commit, as the browser parsed the page.
    commits = json.loads(_ftrun(ended_job, "report", ended_job["run_id"], "--json").stdout)[
        "history"]["snapshot_commits"]
    marks = re.findall(r'<line class="commit"[^>]*><title>committed step (\d+) at', dom.stdout)
    assert commits and [int(m) for m in marks] == [c["step"] for c in commits], marks
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # no error, no warning, no blocked load

    bare = tmp_path / "bare.html"
    html = page.read_text()
    # The same page with the picture's contents taken out (its box kept: the same layout).
    bare.write_text(re.sub(r"(<svg[^>]*>).*?(</svg>)", r"\1\2", html, count=1, flags=re.S))
    shots = []
    for name, source in (("with", page), ("without", bare)):
        shot = tmp_path / f"{name}.png"
        done = _browse(browser, tmp_path / "profile", source, f"--screenshot={shot}")
        assert done.returncode == 0 and shot.stat().st_size > 0, done.stderr[-3000:]
        shots.append(shot.read_bytes())
    assert shots[0] != shots[1], "the timeline drew nothing the browser shows"


# -- a spare that took over -------------------------------------------------------------------


def _node_state(run_id: str, state: Path, pid: int) -> str | None:
    """The state the live status gives the launcher of ``pid`` (None: not listed yet)."""
    from ftrun import jobs
    from ftrun.coordinator.client import request

    job = jobs.read_job_file(run_id, str(state))
    doc = request(job.endpoint, jobs.load_secret(run_id, str(state), create=False), run_id,
                  "status_request", {}, timeout_s=5).body["doc"]
    return next((n["state"] for n in doc["nodes"] if n.get("pid") == pid), None)


@pytest.mark.integration
def test_a_spare_s_wait_is_reported(tmp_path: Path) -> None:
    """Two launchers train (one rank each, c10d on localhost), a third started once they
    trained waits as the spare; the launcher that does not run the coordinator is SIGKILLed
    with its rank. The spare takes over, and the report's spare line runs from the spare's
    rendezvous start to its end, across the kill."""
    import os
    import signal
    import time

    from conftest import free_port, wait_for

    state = tmp_path / "state"
    run_id = f"spare-{uuid.uuid4().hex[:8]}"
    env = {"FTRUN_STATE_DIR": str(state)}
    port = free_port()
    args = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--node-timeout", "6",
            "--max-restarts", "3", TRAIN, "--steps", "60", "--step-sleep", "0.2",
            "--snapshot-every", "1")
    job_file = state / "jobs" / run_id / "job.json"
    procs = Procs(tmp_path)
    try:
        first = procs.ftrun(*args, env=env, name="node0")  # binds the port: runs the store
        wait_for(job_file.exists, 120, "the job file")
        second = procs.ftrun(*args, env=env, name="node1")

        log_file = state / "jobs" / run_id / "events.jsonl"

        def events() -> list[dict]:
            return read_events(state, run_id) if log_file.exists() else []

        # The ranks restored (nothing: a fresh start), so the first world trains.
        wait_for(lambda: any(e["type"] == "restore" for e in events()), 120,
                 "the two launchers to train")
        spare = procs.ftrun(*args, env=env, name="spare")
        wait_for(lambda: any(e["type"] == "node_joined" and e["node"].endswith(f"/{spare.pid}")
                             for e in events()), 60, "the spare to join")
        coordinator_pid = json.loads(job_file.read_text())["pid"]
        [victim] = [p for p in (first, second) if p.pid != coordinator_pid]
        survivor = first if victim is second else second
        wait_for(lambda: _node_state(run_id, state, spare.pid) == "rendezvous", 60,
                 "the spare to wait in its rendezvous")
        t_kill = time.time()
        os.killpg(victim.pid, signal.SIGKILL)  # the launcher and its rank: a node lost
        assert procs.wait(survivor, 240) == 0, procs.output(survivor)[-4000:]
        assert procs.wait(spare, 120) == 0, procs.output(spare)[-4000:]
    finally:
        procs.cleanup()
    log = read_events(state, run_id)
    spare_node = next(e["node"] for e in log
                      if e["type"] == "node_joined" and e["node"].endswith(f"/{spare.pid}"))
    assert any(e["type"] == "workers_started" and e["node"] == spare_node and e["ts"] > t_kill
               for e in log), "the spare never started workers"
    out = subprocess.run([sys.executable, "-m", "ftrun", "report", run_id, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    [row] = doc["history"]["spares"]
    assert row["node"] == spare_node and row["took_over_at"] is not None
    # It waited from before the kill (it had joined by then) until it took over after it.
    assert row["waited_from"] < t_kill < row["took_over_at"], (row, t_kill)
    assert row["waited_s"] == pytest.approx(row["took_over_at"] - row["waited_from"], abs=1e-2)
    assert doc["time"]["beside"]["spare_wait_s"] == row["waited_s"]
    text = subprocess.run([sys.executable, "-m", "ftrun", "report", run_id], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **env, "COLUMNS": "200"})
    assert "spares waiting (1 launcher(s); beside the wall time)" in text.stdout, text.stdout
