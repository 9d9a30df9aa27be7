"""Reports aggregated on the way, on network namespaces (ftrun.coordinator.aggregation): a hang
named from the ranks' collective reports summarised by their launchers and merged by their
group's aggregator (ftrun.coordinator.collsum, FTRUN_COLL_SUMMARY_RANKS=0: as a job past the
summary size would) and acted on through the aggregator, then the aggregator's host killed,
with no false "lost".

Groups of 2 launchers (FTRUN_AGGREGATE_GROUP=2): of the three training hosts, node ranks 0
and 1 form a group, aggregated by the one that is not host 0 (host 0 runs the coordinator,
which does not aggregate when another member can), and node rank 2 reports directly. Rank 0
runs on host 0 (ranks follow the hosts' names); host 3 waits as the spare.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from conftest import wait_for
from netns import (  # noqa: F401  (the fixtures)
    KILL_AT,
    STEPS,
    Job,
    cluster_fixture,
    reference_3_fixture,
)

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # see tests/test_detect_integ.py

HANG_AT = KILL_AT  # rank 0 (host 0, a member of the group) hangs in a collective here
HOST_KILL_AT = 12  # the group's aggregator is killed once this step is done (of STEPS)


def test_hang_acted_on_through_an_aggregator_and_its_host_killed_without_a_false_lost(
        cluster_factory, state_dir: Path, exact_steps: None, reference_3: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_AGGREGATE_GROUP", "2")
    monkeypatch.setenv("FTRUN_COLL_SUMMARY_RANKS", "0")
    c = cluster_factory(4)
    job = Job(c, state_dir, "aggr")
    schedule = tmp_path / "faults.json"
    schedule.write_text(json.dumps([{"step": HANG_AT, "rank": 0, "mode": "collective-hang"}]))
    train = ["--fault-schedule", str(schedule)]
    job.start(range(3), "3", train_args=train)
    job.wait_step(1)
    job.start([3], "3", train_args=train)  # the spare

    def node_of(host: int) -> str:
        return next(n["node_id"] for n in job.status()["nodes"]
                    if n["host"] == c.hostname(host) and not (n["lost"] or n["left"]))

    # One group of two (ranks 0 and 1) and rank 2 alone: the group's aggregator is not host
    # 0 (the coordinator's host), which reports through it.
    agg = wait_for(lambda: (a := job.status()["coordinator"]["aggregation"])["groups"] == 1
                   and a["members_via_aggregator"] == 1 and a, 60, "the group's plan",
                   interval_s=0.3)
    [aggregator] = agg["aggregators"]
    victim = c.namespaces.index(aggregator.split("/")[0])
    assert victim in (1, 2), (aggregator, victim)

    # The hang: named, and its restart order reaches host 0 through the aggregator.
    hang = wait_for(lambda: [e for e in job.events() if e["type"] == "detection"
                             and e["kind"] == "hang"], 90, "the hang named", interval_s=0.2)
    assert hang[0]["ranks"] == [0] and hang[0]["action"] == "restart", hang
    # Named from summaries: rank 0 never entered the op the other two wait in, and waits in
    # the side group instead (so the short threshold applies).
    ev = hang[0]["evidence"]
    assert ev["summarised"] and ev["reason"] == "behind" and ev["waiting_ranks"] == 2, ev
    assert list(ev["waiting_elsewhere"]) == ["0"], ev
    counters = job.status()["detection"]["counters"]
    assert counters["summaries"] > 0 and counters["reports"] == 0, counters
    host0 = node_of(0)
    wait_for(lambda: [e for e in job.events() if e["type"] == "directive_acked"
                      and e.get("action") == "restart" and e["node"] == host0], 30,
             "the restart order carried out on host 0", interval_s=0.2)
    assert "reporting through " + aggregator in c.output(job.nodes[0])
    assert f"(restart) handed on to {host0}" in c.output(job.nodes[victim])

    # The aggregator's host dies.
    job.wait_step(HOST_KILL_AT)
    t_kill = time.time()
    c.kill_host(victim)
    done = max(r["step"] for r in job.steps())
    assert done < STEPS, f"the training ended (step {done}) before the kill: nothing to test"
    assert job.finish() == reference_3
    events = job.events()
    lost = [e["node"] for e in events if e["type"] == "node_lost"]
    assert lost == [aggregator], f"lost: {lost} (only the aggregator {aggregator} died)"
    resumed = json.loads(job.result.read_text())["resumed_from"]
    assert len(resumed) >= 2, resumed  # after the hang, and after the kill
    after = [e for e in events if e["type"] == "workers_started" and e["ts"] > t_kill
             and e["node"].startswith(c.hostname(3) + "/")]
    assert after, "the spare never started workers"
    [marker] = Path(state_dir).rglob(f"fault-fired-rank0-step{HANG_AT}")
    t_hang = json.loads(marker.read_text().splitlines()[0])["time"]
    log.info("aggregated: hang named %.1f s after it began; resumed %.1f s after the kill",
             hang[0]["ts"] - t_hang, job.resumed_after(t_kill))
