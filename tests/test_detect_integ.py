"""Detection on network namespaces: the coordinator compares the ranks' collectives, names
the hung rank, the slow rank or the slow host, acts on it, and the job ends bit-identical to
the fault-free run.

Ranks are assigned in the order of the hosts' names, so with hosts 0, 1, 2 training (one
rank each) rank i runs on host i; a spare, started after them, waits. Host 0 runs the
coordinator and is never the victim (isolating it would end the job).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FULL_MATRIX, wait_for
from netns import (  # noqa: F401  (the fixtures)
    KILL_AT,
    Cluster,
    Job,
    cluster_fixture,
    reference_3_fixture,
)

from ftrun.exit_codes import ISOLATED

log = logging.getLogger(__name__)

# Timing-sensitive (slow ranks named, healthy runs with no suspect): run alone, after the
# parallel part of the suite (scripts/test.sh), never beside another test's processes.
pytestmark = [pytest.mark.integration, pytest.mark.serial]


def _detections(job: Job, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in job.events()
            if e["type"] == "detection" and (kind is None or e["kind"] == kind)]


def _fault_time(job: Job) -> float:
    """When the injected fault fired (its marker, written by the rank just before)."""
    markers = list(Path(job.state_dir).rglob("fault-fired-rank*"))
    assert markers, f"the fault never fired (no marker under {job.state_dir})"
    return json.loads(markers[0].read_text().splitlines()[0])["time"]


def _spare(job: Job, host: int, nnodes: str, *extra: str, **kw: Any) -> None:
    """Start ``host`` once the others trained a step: it waits as the spare."""
    job.wait_step(1)
    job.start([host], nnodes, *extra, **kw)


def test_stopped_rank_is_named_its_host_isolated_and_the_job_matches_fault_free(
        cluster_factory, state_dir: Path, exact_steps: None, reference_3: str) -> None:
    """Rank 1 stops itself (SIGSTOP) at step KILL_AT. Its collective reports stop while the
    others wait for it: the coordinator names rank 1 (a hang), isolates host 1 (--on-hang
    isolate), whose launcher exits 8; the spare takes its place, every rank resumes from the
    snapshot, and the final weights equal the fault-free run's."""
    c = cluster_factory(4)
    job = Job(c, state_dir, "stop")
    flags = ("--on-hang", "isolate")
    fault = ["--fail-at-step", str(KILL_AT), "--fail-rank", "1", "--fail-mode", "stop"]
    job.start(range(3), "3", *flags, train_args=fault)
    _spare(job, 3, "3", *flags, train_args=fault)
    assert job.finish(skip=[1]) == reference_3
    victim = job.nodes[1]
    assert c.wait(victim, 60) == ISOLATED, c.output(victim)[-3000:]
    assert "isolated" in c.output(victim)
    [hang] = _detections(job, "hang")
    assert hang["ranks"] == [1] and hang["hosts"] == [c.hostname(1)], hang
    isolated = [e for e in job.events() if e["type"] == "host_isolated"]  # the decision
    assert [e["host"] for e in isolated] == [c.hostname(1)], isolated
    left = [e for e in job.events() if e["type"] == "node_isolated"]  # carried out
    assert [e["host"] for e in left] == [c.hostname(1)], left
    excluded = json.loads((Path(state_dir) / "jobs" / job.run_id / "excluded.json").read_text())
    assert list(excluded["hosts"]) == [c.hostname(1)]
    t_fault = _fault_time(job)
    log.info("stopped rank: detected %.1f s and training resumed %.1f s after the fault",
             hang["ts"] - t_fault, job.resumed_after(t_fault))


def test_rank_inside_a_collective_that_never_returns_is_named_and_killed(
        cluster_factory, state_dir: Path, exact_steps: None, reference_3: str) -> None:
    """Rank 1 enters an all-reduce that no other rank enters (--fail-mode collective-hang):
    it never returns, and the others wait for rank 1 in the next collective. The coordinator
    names rank 1; with the default --on-hang restart its launcher kills it at once (no
    collective timeout), every rank restarts from the snapshot, and the final weights equal
    the fault-free run's."""
    c = cluster_factory(3)
    job = Job(c, state_dir, "collhang")
    fault = ["--fail-at-step", str(KILL_AT), "--fail-rank", "1", "--fail-mode", "collective-hang"]
    job.start(range(3), "3", train_args=fault)
    assert job.finish() == reference_3
    [hang] = _detections(job, "hang")
    assert hang["ranks"] == [1] and hang["action"] == "restart", hang
    restarts = [e for e in job.events() if e["type"] == "directive_acked"
                and e.get("action") == "restart"]
    assert restarts, "no restart directive was carried out"
    t_fault = _fault_time(job)
    log.info("collective hang: detected %.1f s and training resumed %.1f s after the fault",
             hang["ts"] - t_fault, job.resumed_after(t_fault))


# ~70 s serial: test_detect's slow-rank analyses and the launchers' collective hang test
# (test_launcher_integ: the same reports, collector and coordinator) run in CI.
@FULL_MATRIX
def test_slow_rank_is_flagged_within_twenty_steps(cluster_factory, state_dir: Path) -> None:
    """Rank 2 computes twice as slowly (--slow-rank 2 --slow-factor 2) from the first step: it
    is flagged slow, by name, within 20 steps, and nothing else is flagged.

    The model (--dim 256) computes for about 150 ms a step here, so rank 2 is that late: well
    above the 50 ms lateness floor. With --dim 128 its lateness (60-85 ms) sat at the floor
    and at the 20 ms polling resolution of gloo, and whether it was flagged by step 20 was
    chance."""
    c = cluster_factory(3)
    job = Job(c, state_dir, "slow")
    job.start(range(3), "3", "--on-slow", "warn", steps=60,
              train_args=["--slow-rank", "2", "--slow-factor", "2", "--dim", "256",
                          "--layers", "4", "--step-sleep", "0"])
    job.finish()
    found = _detections(job)
    assert found, "the slow rank was never flagged"
    assert {e["kind"] for e in found} == {"slow_rank"}, found
    assert found[0]["ranks"] == [2], found[0]
    steps = [r for r in job.steps() if r["time"] <= found[0]["ts"]]
    log.info("slow rank flagged after %d steps: %s", len(steps), found[0].get("evidence"))
    assert len(steps) <= 20, f"flagged after {len(steps)} steps"


def test_rate_limited_link_is_localised_to_its_host_by_probes(cluster_factory,
                                                              state_dir: Path) -> None:
    """Host 1's link is rate-limited (tc tbf) while the job trains. The all-reduces slow
    down with the ranks arriving together (slow communication); the coordinator has the
    launchers probe each other, and the probe matrix names host 1."""
    c = cluster_factory(3)
    job = Job(c, state_dir, "slowlink")
    # No replicas: their traffic would crowd the slowed link and blur what is measured.
    job.start(range(3), "3", steps=400, replicas=1, train_args=["--step-sleep", "0.05"])
    job.wait_step(30)
    t_slow = time.time()
    c.slow_link(1, "8mbit")

    def named() -> dict | None:
        hits = [e for e in _detections(job, "slow_host") if e["hosts"] == [c.hostname(1)]]
        return hits[0] if hits else None

    hit = wait_for(named, 120, "the probes to name host 1")
    assert _detections(job, "slow_comm"), "probes ran without a slow-communication finding"
    probes = [e for e in job.events() if e["type"] == "probe_result"]
    assert probes, "no probe results were recorded"
    c.unslow_link(1)
    log.info("slow link: host 1 named %.1f s after the rate limit", hit["ts"] - t_slow)


def test_healthy_run_has_no_suspects(cluster_factory, state_dir: Path) -> None:
    """Several hundred steps of a healthy, noisy job (three ranks sharing two cores with
    everything else on this machine): not one finding."""
    c = cluster_factory(3)
    job = Job(c, state_dir, "healthy")
    job.start(range(3), "3", steps=300, train_args=["--step-sleep", "0.01"])
    job.finish(timeout_s=400)
    assert _detections(job) == []
    reports = [e for e in job.events() if e["type"] == "job_end"]
    assert reports, "the job never ended"
